"""Agent reports into the store, and the agent's commands back in the reply.

Trust and idempotence live here, apart from HTTP:
- a batch is accepted only with its run's token (compared in constant time against the stored
  hash); a token of another run is as wrong as no token;
- agents resend a batch until it is acknowledged: a sequence number at or below the agent's
  cursor is acknowledged again and written nothing;
- the reply carries what the agent must do, read from the store (so a daemon restart loses
  none of it): leave when its node is denied for the run, restart its workers when a hang was
  decided for it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.db.ingest import record_heartbeats, record_step_times
from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    AgentCursor,
    Attempt,
    DenylistEntry,
    Event,
    EventKind,
    FaultClass,
    Run,
)
from slurmft.db.records import denied_nodes, finish_action, record_event
from slurmft.errors import SlurmftError
from slurmft.protocol import (
    AgentBatch,
    BatchReply,
    Command,
    CommandKind,
    heartbeat_reports,
    step_time_reports,
    utc,
)


class IngestRefused(SlurmftError):
    """The batch is refused; ``status`` is the HTTP status the agent gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def new_run_token() -> tuple[str, str]:
    """A run's token (given to its agents) and the hash the store keeps."""
    token = secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _authorize(session: Session, run_id: str, token: str) -> Run:
    run = session.get(Run, run_id)
    # The same answer for an unknown run and a wrong token: a token does not reveal run ids.
    if (
        run is None
        or run.token_hash is None
        or not hmac.compare_digest(run.token_hash, hash_token(token))
    ):
        raise IngestRefused(403, f"token not valid for run {run_id}")
    return run


def ingest_batch(
    session: Session,
    batch: AgentBatch,
    token: str,
    *,
    now: datetime,
    sample_every: timedelta = timedelta(seconds=60),
) -> BatchReply:
    """Store one agent batch (once) and answer with the agent's commands."""
    run = _authorize(session, batch.run_id, token)
    cursor = session.get(AgentCursor, (run.id, batch.agent_id))
    if cursor is None or batch.seq > cursor.last_seq:
        _store(session, run, batch, now, sample_every)
        if cursor is None:
            session.add(
                AgentCursor(
                    run_id=run.id,
                    agent_id=batch.agent_id,
                    node=batch.node,
                    last_seq=batch.seq,
                    updated_at=now,
                )
            )
        else:
            cursor.last_seq, cursor.updated_at = batch.seq, now
    return BatchReply(
        acked_seq=batch.seq,
        server_time=now.timestamp(),
        commands=tuple(_commands(session, run, batch.node)),
    )


def _store(
    session: Session, run: Run, batch: AgentBatch, now: datetime, sample_every: timedelta
) -> None:
    attempt_id = session.scalar(
        select(Attempt.id).where(Attempt.run_id == run.id).order_by(Attempt.number.desc()).limit(1)
    )
    record_heartbeats(
        session,
        run.id,
        attempt_id,
        heartbeat_reports(batch),
        sample_every=sample_every,
        received_at=now,
    )
    record_step_times(session, run.id, attempt_id, step_time_reports(batch))
    for event in batch.events:
        row = record_event(
            session,
            EventKind(event.kind),
            event.message,
            run_id=run.id,
            attempt_id=attempt_id,
            node=batch.node,
            rank=event.rank,
            fault_class=FaultClass(event.fault_class) if event.fault_class else None,
            xid=_int_or_none(event.details.get("xid")),
            gpu_index=_int_or_none(event.details.get("gpu_index")),
            details={**event.details, "agent_id": batch.agent_id},
            source="agent",
            occurred_at=utc(event.occurred_at),
        )
        if row.kind is EventKind.HANG and event.details.get("stacks"):
            _attach_stacks(session, run, batch.node, row)


def _attach_stacks(session: Session, run: Run, node: str, event: Event) -> None:
    """The stacks an agent saved before it killed workers on the daemon's command become the
    evidence of that restart_workers action (the agent's event quotes the command's reason)."""
    delivered = session.scalars(
        select(Action)
        .where(
            Action.run_id == run.id,
            Action.node == node,
            Action.kind == ActionKind.RESTART_WORKERS,
            Action.status == ActionStatus.DONE,
            Action.event_id.is_(None),
        )
        .order_by(Action.id.desc())
    ).all()
    action = next((a for a in delivered if a.reason in event.message), None)
    if action is None:
        return  # the agent found the hang itself (a phase past its deadline)
    action.event_id = event.id
    # A new dict: the JSON column sees reassignment, not in-place changes.
    action.evidence = {
        **action.evidence,
        "stacks_event_id": event.id,
        "stacks": event.details["stacks"],
        "stack_files": event.details.get("stack_files", {}),
    }


def _commands(session: Session, run: Run, node: str) -> list[Command]:
    if node in denied_nodes(session, run_id=run.id):
        reason = session.scalar(
            select(DenylistEntry.reason)
            .where(DenylistEntry.node == node, DenylistEntry.removed_at.is_(None))
            .order_by(DenylistEntry.added_at.desc())
            .limit(1)
        )
        return [Command(CommandKind.LEAVE.value, reason or "node excluded from this run")]
    pending = session.scalars(
        select(Action).where(
            Action.run_id == run.id,
            Action.node == node,
            Action.kind == ActionKind.RESTART_WORKERS,
            Action.status == ActionStatus.PLANNED,
        )
    ).all()
    for action in pending:  # delivered now: the agent acts on it with this reply
        finish_action(action, ActionStatus.DONE)
    return [Command(CommandKind.RESTART_WORKERS.value, pending[-1].reason)] if pending else []


def _int_or_none(value: object) -> int | None:
    """An Xid or GPU index from an agent's event details; anything else is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
