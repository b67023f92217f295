"""Recording what happened and what the controller did: events, actions, the denylist.

Every action is written *before* it is executed (status ``planned``) and finished afterwards
(``done``, ``failed`` with the error, or ``skipped`` with why), so a crash in between leaves a
visible planned row rather than an effect nobody recorded.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, or_, select
from sqlalchemy.orm import Session

from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    DenylistEntry,
    Event,
    EventKind,
    FaultClass,
    utcnow,
)
from slurmft.slurm.names import check_node_name, is_node_name


def record_event(
    session: Session,
    kind: EventKind,
    message: str,
    *,
    run_id: str | None = None,
    attempt_id: int | None = None,
    node: str | None = None,
    rank: int | None = None,
    fault_class: FaultClass | None = None,
    xid: int | None = None,
    gpu_index: int | None = None,
    details: dict[str, Any] | None = None,
    source: str = "daemon",
    occurred_at: datetime | None = None,
    foreign: bool | None = None,
) -> Event:
    """One event row. An agent's is judged later against its attempt's allocation (``foreign``
    NULL until then: slurmft.controller.allocation); the daemon's own is never foreign."""
    event = Event(
        run_id=run_id,
        attempt_id=attempt_id,
        kind=kind,
        fault_class=fault_class,
        node=node,
        rank=rank,
        xid=xid,
        gpu_index=gpu_index,
        message=message,
        details=details or {},
        source=source,
        foreign=foreign if foreign is not None or source == "agent" else False,
        occurred_at=occurred_at or utcnow(),
    )
    session.add(event)
    session.flush()
    return event


def named_by_own_evidence(session: Session, node: str, run_id: str | None) -> bool:
    """Some event of the run (of any run, without one) that was judged the run's own names the
    node: the only ground on which the daemon drains it for everyone."""
    query = select(Event.id).where(Event.node == node, Event.foreign.is_(False))
    if run_id is not None:
        query = query.where(Event.run_id == run_id)
    else:
        query = query.where(Event.run_id.is_not(None))
    return session.scalars(query.limit(1)).first() is not None


def plan_action(
    session: Session,
    kind: ActionKind,
    reason: str,
    *,
    run_id: str | None = None,
    attempt_id: int | None = None,
    node: str | None = None,
    event_id: int | None = None,
    evidence: dict[str, Any] | None = None,
) -> Action:
    action = Action(
        kind=kind,
        reason=reason,
        run_id=run_id,
        attempt_id=attempt_id,
        node=node,
        event_id=event_id,
        evidence=evidence or {},
        status=ActionStatus.PLANNED,
    )
    session.add(action)
    session.flush()
    return action


def finish_action(action: Action, status: ActionStatus, *, error: str | None = None) -> Action:
    if status is ActionStatus.PLANNED:
        raise ValueError("finish an action as done, failed or skipped")
    action.status = status
    action.error = error
    action.finished_at = utcnow()
    return action


# Why an action was recorded as skipped in observe-only mode (daemon.observe_only).
OBSERVE_ONLY = "observe-only mode: decided and recorded, not executed"

# Why a planned agent command was finished without being delivered.
EXPIRED = "expired: not delivered to the node's agent in time"


def expire_planned_restarts(session: Session, *, older_than: datetime) -> int:
    """Finish the planned ``restart_workers`` commands created before ``older_than`` as
    skipped, EXPIRED (the ingest endpoint no longer delivers them); returns how many."""
    rows = session.scalars(
        select(Action).where(
            Action.kind == ActionKind.RESTART_WORKERS,
            Action.status == ActionStatus.PLANNED,
            Action.created_at < older_than,
        )
    ).all()
    for row in rows:
        finish_action(row, ActionStatus.SKIPPED, error=EXPIRED)
    return len(rows)


MAX_CONTROL_ERROR_CHARS = 2000


def record_control_error(
    session: Session, run_id: str | None, stage: str, error: str
) -> Event | None:
    """A failure in one run's part of a control pass (observing, deciding or acting for it):
    an event on that run, once per distinct error (the same one comes every pass until its
    cause is fixed); None when it was recorded already."""
    message = f"control pass: {stage} failed: {error}"[:MAX_CONTROL_ERROR_CHARS]
    same_run = Event.run_id == run_id if run_id is not None else Event.run_id.is_(None)
    seen = session.scalars(
        select(Event.id)
        .where(same_run, Event.kind == EventKind.CONTROL_ERROR, Event.message == message)
        .limit(1)
    ).first()
    if seen is not None:
        return None
    return record_event(
        session, EventKind.CONTROL_ERROR, message, run_id=run_id, details={"stage": stage}
    )


def denylist_add(
    session: Session,
    node: str,
    reason: str,
    *,
    run_id: str | None = None,
    action_id: int | None = None,
    expires_at: datetime | None = None,
) -> DenylistEntry:
    """Keep ``node`` out of one run (``run_id``) or of every run; an active entry is reused.
    A name that is not a Slurm node name is refused (InvalidNodeName): it would reach every
    later sbatch and scontrol exclude list, and fail them all."""
    check_node_name(node)
    existing = session.scalars(_active_for(node, run_id)).first()
    if existing is not None:
        return existing
    entry = DenylistEntry(
        node=node, reason=reason, run_id=run_id, action_id=action_id, expires_at=expires_at
    )
    session.add(entry)
    session.flush()
    return entry


def denylist_remove(session: Session, node: str, *, run_id: str | None = None) -> int:
    """End the active entries for ``node`` (of one run, or the global ones); returns how many."""
    return _end(session, _active_for(node, run_id))


def denylist_release(session: Session, node: str) -> int:
    """End every active entry for ``node``, of every run and of all runs; returns how many."""
    return _end(session, _active(utcnow()).where(DenylistEntry.node == node))


def _end(session: Session, entries: Select[DenylistEntry]) -> int:
    now = utcnow()
    ended = session.scalars(entries).all()
    for entry in ended:
        entry.removed_at = now
    return len(ended)


def active_denylist(session: Session, *, now: datetime | None = None) -> list[DenylistEntry]:
    """Every active entry (not removed, not expired), oldest first."""
    return list(session.scalars(_active(now or utcnow()).order_by(DenylistEntry.id)))


def denied_nodes(
    session: Session, *, run_id: str | None = None, now: datetime | None = None
) -> frozenset[str]:
    """Nodes kept out of every run, plus (with ``run_id``) those kept out of that run."""
    scope: ColumnElement[bool] = DenylistEntry.run_id.is_(None)
    if run_id is not None:
        scope = or_(scope, DenylistEntry.run_id == run_id)
    rows: Iterable[str] = session.scalars(
        _active(now or utcnow()).with_only_columns(DenylistEntry.node).where(scope)
    )
    # Every exclude list is built from this: a name that is not a node name (written before
    # names were checked, by hand) never reaches Slurm; migration 0006 retires such entries.
    return frozenset(node for node in rows if is_node_name(node))


def _active(now: datetime) -> Select[DenylistEntry]:
    return select(DenylistEntry).where(
        DenylistEntry.removed_at.is_(None),
        or_(DenylistEntry.expires_at.is_(None), DenylistEntry.expires_at > now),
    )


def _active_for(node: str, run_id: str | None) -> Select[DenylistEntry]:
    """Active entries of exactly this scope: the run's own, or the global ones."""
    same_scope = (
        DenylistEntry.run_id.is_(None) if run_id is None else DenylistEntry.run_id == run_id
    )
    return _active(utcnow()).where(DenylistEntry.node == node, same_scope)
