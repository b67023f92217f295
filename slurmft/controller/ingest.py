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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import bindparam, or_, select
from sqlalchemy.orm import Session

from slurmft.config import PolicySection
from slurmft.controller.limits import AuditThrottle, IngestLimiter
from slurmft.db.ingest import (
    HeartbeatReport,
    RunReports,
    StepTimeReport,
    record_agent_cursors,
    record_reports,
)
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
from slurmft.db.records import finish_action, plan_action, record_event
from slurmft.errors import SlurmftError
from slurmft.protocol import (
    AgentBatch,
    AgentEvent,
    AllocationReport,
    BatchReply,
    Command,
    CommandKind,
    ItemsRefused,
    ProtocolError,
    check_header,
    item_refusals,
    utc,
)

# --- the wire's records as the store's rows ----------------------------------------------------


def heartbeat_reports(batch: AgentBatch) -> list[HeartbeatReport]:
    """The store's heartbeat rows. `seq` is the send time in microseconds, not the batch seq:
    when a spare takes over a rank, its agent's batch numbers start again at 1, but the rank's
    newest heartbeat must still win (clock skew between nodes is checked to stay under 1 s)."""
    return [
        HeartbeatReport(
            rank=hb.rank,
            node=batch.node,
            phase=hb.phase,
            step=hb.step,
            seq=round(hb.sent_at * 1_000_000),
            sent_at=utc(hb.sent_at),
            progress_age_s=hb.progress_age_s,
            deadline_s=hb.deadline_s,
        )
        for hb in batch.heartbeats
    ]


def step_time_reports(batch: AgentBatch) -> list[StepTimeReport]:
    return [
        StepTimeReport(
            rank=st.rank,
            step=st.step,
            compute_s=st.compute_s,
            wait_s=st.wait_s,
            ended_at=utc(st.ended_at),
            peer_group=st.peer_group,
        )
        for st in batch.step_times
    ]


class IngestRefused(SlurmftError):
    """The batch is refused; ``status`` is the HTTP status the agent gets. ``items``: the
    refused items when only they are the reason (422); ``retry_after_s``: when to try again
    (429)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        items: ItemsRefused | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.items = items
        self.retry_after_s = retry_after_s


def new_run_token() -> tuple[str, str]:
    """A run's token (given to its agents) and the hash the store keeps."""
    token = secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


_RUNS = Run.__table__
_ATTEMPTS = Attempt.__table__
_CURSORS = AgentCursor.__table__
_DENYLIST = DenylistEntry.__table__

# Built once, like all below: building a statement costs more than running it for one group.
# The runs' token hashes and latest attempts.
_RUN_STATES = select(
    _RUNS.c.id,
    _RUNS.c.token_hash,
    _RUNS.c.owner_name,
    select(_ATTEMPTS.c.id)
    .where(_ATTEMPTS.c.run_id == _RUNS.c.id)
    .order_by(_ATTEMPTS.c.number.desc())
    .limit(1)
    .scalar_subquery(),
).where(_RUNS.c.id.in_(bindparam("runs", expanding=True)))
_AGENT_CURSORS = select(_CURSORS.c.run_id, _CURSORS.c.agent_id, _CURSORS.c.last_seq).where(
    _CURSORS.c.run_id.in_(bindparam("runs", expanding=True)),
    _CURSORS.c.agent_id.in_(bindparam("agents", expanding=True)),
)
_AGENTS_PER_READ = 500
# Nodes kept out of every run, or out of one of these runs (records.denied_nodes).
_DENIED = (
    select(_DENYLIST.c.node, _DENYLIST.c.run_id, _DENYLIST.c.reason)
    .where(
        _DENYLIST.c.node.in_(bindparam("nodes", expanding=True)),
        _DENYLIST.c.removed_at.is_(None),
        or_(_DENYLIST.c.expires_at.is_(None), _DENYLIST.c.expires_at > bindparam("now")),
        or_(
            _DENYLIST.c.run_id.is_(None),
            _DENYLIST.c.run_id.in_(bindparam("runs", expanding=True)),
        ),
    )
    .order_by(_DENYLIST.c.added_at)
)
_RESTARTS_PLANNED = select(Action).where(
    Action.run_id.in_(bindparam("runs", expanding=True)),
    Action.kind == ActionKind.RESTART_WORKERS,
    Action.status == ActionStatus.PLANNED,
    Action.created_at >= bindparam("not_before"),  # an older one expired: never sent late
)
# How long a planned restart_workers command waits for its agent (policy.restart_command_ttl_s).
RESTART_COMMAND_TTL = timedelta(seconds=PolicySection.restart_command_ttl_s)


@dataclass(frozen=True)
class _RunState:
    run_id: str
    token_hash: str
    owner_name: str
    attempt_id: int | None


def ingest_batches(
    session: Session,
    posts: Sequence[tuple[AgentBatch, str]],
    *,
    now: datetime,
    sample_every: timedelta = timedelta(seconds=60),
    restart_ttl: timedelta = RESTART_COMMAND_TTL,
    limiter: IngestLimiter | None = None,
    audit: AuditThrottle | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> list[BatchReply | IngestRefused]:
    """Store the batches of many agents (each once) in this session's transaction, and answer
    each with its agent's commands, or with why it is refused (in the order of ``posts``).

    Each batch is checked (token, bounds, the run's ingest rate) before anything is written,
    so a refused batch writes nothing and never fails the group's transaction for the others.
    A constant number of statements whatever the number of batches: the daemon commits the
    batches that arrive together as one group (controller.group_commit)."""
    malformed = {index: _malformed(batch, now) for index, (batch, _) in enumerate(posts)}
    readable = [post for index, post in enumerate(posts) if malformed[index] is None]
    runs = _run_states(session, {batch.run_id for batch, _ in readable})
    cursors = _agent_cursors(session, readable)
    accepted: list[AgentBatch | IngestRefused] = []
    fresh: list[tuple[_RunState, AgentBatch]] = []
    for index, (batch, token) in enumerate(posts):
        header_refused = malformed[index]
        if header_refused is not None:  # never compared with the store (a NUL in a key)
            accepted.append(header_refused)
            continue
        run = runs.get(batch.run_id)
        # The same answer for an unknown run and a wrong token: a token does not reveal run ids.
        if run is None or not hmac.compare_digest(run.token_hash, hash_token(token)):
            accepted.append(IngestRefused(403, f"token not valid for run {batch.run_id}"))
            continue
        refused = _refusal(
            session, run, batch, now=now, limiter=limiter, audit=audit, now_s=monotonic()
        )
        if refused is not None:
            accepted.append(refused)
            continue
        accepted.append(batch)
        last_seq = cursors.get((batch.run_id, batch.agent_id))
        if last_seq is None or batch.seq > last_seq:  # at or below: a resend, acknowledged again
            fresh.append((run, batch))
            cursors[batch.run_id, batch.agent_id] = batch.seq
    _store(session, fresh, now, sample_every)
    _write_cursors(session, fresh, now)
    # The batch step's reports get no commands: those are for the agents on its node.
    agents = [b for b in accepted if isinstance(b, AgentBatch) and b.allocation is None]
    commands = _commands(session, agents, now, restart_ttl)
    return [
        b
        if isinstance(b, IngestRefused)
        else BatchReply(
            acked_seq=b.seq,
            server_time=now.timestamp(),
            commands=tuple(commands.get((b.run_id, b.node), ()) if b.allocation is None else ()),
        )
        for b in accepted
    ]


def _malformed(batch: AgentBatch, now: datetime) -> IngestRefused | None:
    try:
        check_header(batch, now.timestamp())
    except ProtocolError as error:
        return IngestRefused(400, str(error))
    return None


def _refusal(
    session: Session,
    run: _RunState,
    batch: AgentBatch,
    *,
    now: datetime,
    limiter: IngestLimiter | None,
    audit: AuditThrottle | None,
    now_s: float,
) -> IngestRefused | None:
    """Why this (authenticated) batch, its header checked, is refused, if it is: items out of
    bounds (422), or over its run's ingest rate (429, recorded at most once a minute per run)."""
    refused = item_refusals(batch, now.timestamp())
    if refused:
        items = ItemsRefused(refused)
        return IngestRefused(422, str(items), items=items)
    if limiter is None:
        return None
    wait = limiter.take(run.run_id, len(batch.events), now_s)
    if not wait:
        return None
    limits = limiter.limits
    message = (
        f"run {run.run_id} is over its ingest rate ({limits.batches_per_s:g} batches and "
        f"{limits.events_per_s:g} events a second, daemon.ingest_*_per_run_s): retry in "
        f"{wait:.1f} s"
    )
    if audit is None or audit.due("ingest_rate", run.run_id, now_s):
        record_refusal(
            session,
            f"{message} (user {run.owner_name})",
            user=run.owner_name,
            limit="ingest_rate",
            run_id=run.run_id,
            node=batch.node,
        )
    return IngestRefused(429, message, retry_after_s=wait)


def record_refusal(
    session: Session,
    reason: str,
    *,
    user: str,
    limit: str,
    run_id: str | None = None,
    node: str | None = None,
) -> None:
    """The audit row of a refusal by a quota or a rate limit: an action that names the user."""
    action = plan_action(
        session,
        ActionKind.REFUSE_REQUEST,
        reason,
        run_id=run_id,
        node=node,
        evidence={"user": user, "limit": limit},
    )
    finish_action(action, ActionStatus.DONE)


def _run_states(session: Session, run_ids: set[str]) -> dict[str, _RunState]:
    rows = session.execute(_RUN_STATES, {"runs": sorted(run_ids)})
    return {
        run_id: _RunState(run_id, token_hash, owner_name, attempt_id)
        for run_id, token_hash, owner_name, attempt_id in rows
        if token_hash is not None
    }


def _agent_cursors(
    session: Session, posts: Sequence[tuple[AgentBatch, str]]
) -> dict[tuple[str, str], int]:
    runs = sorted({batch.run_id for batch, _ in posts})
    agents = sorted({batch.agent_id for batch, _ in posts})
    cursors: dict[tuple[str, str], int] = {}
    for first in range(0, len(agents), _AGENTS_PER_READ):
        chunk = agents[first : first + _AGENTS_PER_READ]
        rows = session.execute(_AGENT_CURSORS, {"runs": runs, "agents": chunk})
        cursors.update(((run_id, agent_id), seq) for run_id, agent_id, seq in rows)
    return cursors


def _write_cursors(
    session: Session, fresh: Sequence[tuple[_RunState, AgentBatch]], now: datetime
) -> None:
    """Move every agent's cursor to its newest stored batch."""
    newest: dict[tuple[str, str], AgentBatch] = {}
    for _, batch in fresh:  # in order: an agent's later batch in the group wins
        newest[batch.run_id, batch.agent_id] = batch
    record_agent_cursors(
        session, [(b.run_id, b.agent_id, b.node, b.seq) for b in newest.values()], now
    )


def _store(
    session: Session,
    fresh: Sequence[tuple[_RunState, AgentBatch]],
    now: datetime,
    sample_every: timedelta,
) -> None:
    by_run: dict[str, tuple[_RunState, list[HeartbeatReport], list[StepTimeReport]]] = {}
    for run, batch in fresh:
        _, beats, times = by_run.setdefault(run.run_id, (run, [], []))
        beats += heartbeat_reports(batch)
        times += step_time_reports(batch)
    record_reports(
        session,
        [
            RunReports(run.run_id, run.attempt_id, beats, times)
            for run, beats, times in by_run.values()
        ],
        sample_every=sample_every,
        received_at=now,
    )
    for run, batch in fresh:
        for event in batch.events:
            _store_event(session, run, batch, event)
        if batch.allocation is not None:
            _store_allocation_report(session, run, batch, batch.allocation)


def _store_allocation_report(
    session: Session, run: _RunState, batch: AgentBatch, report: AllocationReport
) -> None:
    """The batch step's claim, stored as evidence to judge (foreign NULL): the control pass
    checks it against Slurm before any of it becomes the allocation (controller.allocation)."""
    nodes = [{"node": m.node, "role": m.role.value} for m in report.nodes]
    record_event(
        session,
        EventKind.ALLOCATION,
        f"batch step reports job {report.job_id} on {len(nodes)} nodes",
        run_id=run.run_id,
        attempt_id=run.attempt_id,
        node=batch.node,
        details={"job_id": report.job_id, "nodes": nodes, "agent_id": batch.agent_id},
        source="agent",
        occurred_at=utc(batch.sent_at),
    )


def _store_event(session: Session, run: _RunState, batch: AgentBatch, event: AgentEvent) -> None:
    row = record_event(
        session,
        EventKind(event.kind),
        event.message,
        run_id=run.run_id,
        attempt_id=run.attempt_id,
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
        _attach_stacks(session, run.run_id, batch.node, row)


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


def _commands(
    session: Session,
    batches: Sequence[AgentBatch],
    now: datetime,
    restart_ttl: timedelta = RESTART_COMMAND_TTL,
) -> dict[tuple[str, str], list[Command]]:
    """Each (run, node)'s commands: leave when the node is denied for the run (the newest
    entry's reason), else restart the workers when a hang was decided for it within
    ``restart_ttl`` (an older one has expired; the control pass records it so). Two statements
    for the whole group; the action rows are loaded only when one is planned."""
    if not batches:
        return {}
    runs = sorted({b.run_id for b in batches})
    wanted = {(b.run_id, b.node) for b in batches}
    params = {"runs": runs, "nodes": sorted({node for _, node in wanted}), "now": now}
    commands: dict[tuple[str, str], list[Command]] = {}
    for node, run_id, reason in session.execute(_DENIED, params):  # oldest first: newest wins
        leave = Command(CommandKind.LEAVE, reason or "node excluded from this run")
        for key in [(run_id, node)] if run_id else [(r, node) for r in runs]:
            if key in wanted:
                commands[key] = [leave]
    planned: dict[tuple[str, str], list[Action]] = {}
    restarts = {"runs": runs, "not_before": now - restart_ttl}
    for action in session.scalars(_RESTARTS_PLANNED, restarts):
        key = (action.run_id, action.node or "")
        if key in wanted and key not in commands:
            planned.setdefault(key, []).append(action)
    for key, actions in planned.items():
        for action in actions:  # delivered now: the agent acts on it with this reply
            finish_action(action, ActionStatus.DONE)
        commands[key] = [Command(CommandKind.RESTART_WORKERS, actions[-1].reason)]
    return commands


def _int_or_none(value: object) -> int | None:
    """An Xid or GPU index from an agent's event details; anything else is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
