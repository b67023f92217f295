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
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import bindparam, insert, or_, select, update
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
    utcnow,
)
from slurmft.db.records import finish_action, record_event
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


_RUNS = Run.__table__
_CURSORS = AgentCursor.__table__
_ACTIONS = Action.__table__
_DENYLIST = DenylistEntry.__table__

# Everything a batch needs before it is stored, in one statement (built once, like all below:
# a batch is a few ranks, and building a statement costs more than running it): the run's
# token hash, its latest attempt, and the agent's cursor.
_BATCH_STATE = select(
    _RUNS.c.token_hash,
    select(Attempt.__table__.c.id)
    .where(Attempt.__table__.c.run_id == _RUNS.c.id)
    .order_by(Attempt.__table__.c.number.desc())
    .limit(1)
    .scalar_subquery(),
    select(_CURSORS.c.last_seq)
    .where(_CURSORS.c.run_id == _RUNS.c.id, _CURSORS.c.agent_id == bindparam("agent_id"))
    .scalar_subquery(),
).where(_RUNS.c.id == bindparam("run_id"))
_NEW_CURSOR = insert(_CURSORS)
_MOVE_CURSOR = (
    update(_CURSORS)
    .where(_CURSORS.c.run_id == bindparam("run"), _CURSORS.c.agent_id == bindparam("agent"))
    .values(last_seq=bindparam("seq"), updated_at=bindparam("at"))
)
# The node is kept out of every run, or out of this one (records.denied_nodes, for one node).
_NODE_DENIED = select(_DENYLIST.c.id).where(
    _DENYLIST.c.node == bindparam("node"),
    _DENYLIST.c.removed_at.is_(None),
    or_(_DENYLIST.c.expires_at.is_(None), _DENYLIST.c.expires_at > bindparam("now")),
    or_(_DENYLIST.c.run_id.is_(None), _DENYLIST.c.run_id == bindparam("run_id")),
)
_RESTARTS_PLANNED = select(_ACTIONS.c.id).where(
    _ACTIONS.c.run_id == bindparam("run_id"),
    _ACTIONS.c.node == bindparam("node"),
    _ACTIONS.c.kind == ActionKind.RESTART_WORKERS,
    _ACTIONS.c.status == ActionStatus.PLANNED,
)
# The usual reply has no command: both questions in one statement.
_ANY_COMMAND = select(_NODE_DENIED.exists(), _RESTARTS_PLANNED.exists())


@dataclass(frozen=True)
class _BatchState:
    run_id: str
    attempt_id: int | None
    last_seq: int | None  # the agent's cursor; None before its first batch


def _authorize(session: Session, batch: AgentBatch, token: str) -> _BatchState:
    row = session.execute(
        _BATCH_STATE, {"run_id": batch.run_id, "agent_id": batch.agent_id}
    ).first()
    # The same answer for an unknown run and a wrong token: a token does not reveal run ids.
    if row is None or row[0] is None or not hmac.compare_digest(row[0], hash_token(token)):
        raise IngestRefused(403, f"token not valid for run {batch.run_id}")
    return _BatchState(batch.run_id, row[1], row[2])


def ingest_batch(
    session: Session,
    batch: AgentBatch,
    token: str,
    *,
    now: datetime,
    sample_every: timedelta = timedelta(seconds=60),
) -> BatchReply:
    """Store one agent batch (once) and answer with the agent's commands."""
    state = _authorize(session, batch, token)
    if state.last_seq is None or batch.seq > state.last_seq:
        _store(session, state, batch, now, sample_every)
        if state.last_seq is None:
            session.execute(
                _NEW_CURSOR,
                {
                    "run_id": state.run_id,
                    "agent_id": batch.agent_id,
                    "node": batch.node,
                    "last_seq": batch.seq,
                    "updated_at": now,
                },
            )
        else:
            session.execute(
                _MOVE_CURSOR,
                {"run": state.run_id, "agent": batch.agent_id, "seq": batch.seq, "at": now},
            )
    return BatchReply(
        acked_seq=batch.seq,
        server_time=now.timestamp(),
        commands=tuple(_commands(session, state.run_id, batch.node)),
    )


def _store(
    session: Session, state: _BatchState, batch: AgentBatch, now: datetime, sample_every: timedelta
) -> None:
    run_id, attempt_id = state.run_id, state.attempt_id
    record_heartbeats(
        session,
        run_id,
        attempt_id,
        heartbeat_reports(batch),
        sample_every=sample_every,
        received_at=now,
    )
    record_step_times(session, run_id, attempt_id, step_time_reports(batch))
    for event in batch.events:
        row = record_event(
            session,
            EventKind(event.kind),
            event.message,
            run_id=run_id,
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
            _attach_stacks(session, run_id, batch.node, row)


def _attach_stacks(session: Session, run_id: str, node: str, event: Event) -> None:
    """The stacks an agent saved before it killed workers on the daemon's command become the
    evidence of that restart_workers action (the agent's event quotes the command's reason)."""
    delivered = session.scalars(
        select(Action)
        .where(
            Action.run_id == run_id,
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


def _commands(session: Session, run_id: str, node: str) -> list[Command]:
    # Two cheap lookups for the usual answer (no command); the rows are loaded only when found.
    params = {"run_id": run_id, "node": node, "now": utcnow()}
    denied, restarts_planned = session.execute(_ANY_COMMAND, params).one()
    if denied:
        reason = session.scalar(
            select(DenylistEntry.reason)
            .where(DenylistEntry.node == node, DenylistEntry.removed_at.is_(None))
            .order_by(DenylistEntry.added_at.desc())
            .limit(1)
        )
        return [Command(CommandKind.LEAVE.value, reason or "node excluded from this run")]
    if not restarts_planned:
        return []
    pending = session.scalars(
        select(Action).where(
            Action.run_id == run_id,
            Action.node == node,
            Action.kind == ActionKind.RESTART_WORKERS,
            Action.status == ActionStatus.PLANNED,
        )
    ).all()
    for action in pending:  # delivered now: the agent acts on it with this reply
        finish_action(action, ActionStatus.DONE)
    return [Command(CommandKind.RESTART_WORKERS.value, pending[-1].reason)]


def _int_or_none(value: object) -> int | None:
    """An Xid or GPU index from an agent's event details; anything else is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
