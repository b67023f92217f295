"""Where a run is, from the store: for `slurmft status RUN` (in full) and `slurmft runs` (one
line each).

Every figure says where it comes from, and is None where the store cannot know it: a plain
torchrun script that never imports slurmft.train sends no heartbeats, so its step and world
size are unknown (its progress is the newest checkpoint the batch step found on disk).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from slurmft.controller.pass_health import is_held
from slurmft.db.models import (
    Action,
    ActionStatus,
    AllocationNode,
    Attempt,
    Event,
    EventKind,
    RankHeartbeat,
    Run,
)
from slurmft.db.records import denied_nodes
from slurmft.db.states import RunState

# A rank heard from this close to the newest heartbeat of the run is part of its world now; one
# silent longer is a rank of an earlier round (the world shrank) or a hung one.
WORLD_WINDOW = timedelta(seconds=60)


@dataclass(frozen=True)
class Progress:
    step: int | None  # the newest step any rank reported
    world_size: int | None  # ranks heard from within WORLD_WINDOW of the newest heartbeat
    heartbeat_at: datetime | None


def latest_attempt(session: Session, run_id: str) -> Attempt | None:
    return session.scalars(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number.desc()).limit(1)
    ).first()


def _progress(session: Session, run_id: str) -> Progress:
    newest = session.execute(
        select(func.max(RankHeartbeat.step), func.max(RankHeartbeat.sent_at)).where(
            RankHeartbeat.run_id == run_id
        )
    ).one()
    step, at = newest
    if at is None:
        return Progress(None, None, None)
    world = session.scalar(
        select(func.count()).where(
            RankHeartbeat.run_id == run_id, RankHeartbeat.sent_at >= at - WORLD_WINDOW
        )
    )
    return Progress(step, world, at)


def _checkpoint(session: Session, run_id: str, now: datetime) -> dict[str, Any] | None:
    """The newest checkpoint reported: verified by slurmft.train (a step) or found complete on
    disk by the batch step (a label)."""
    row = session.execute(
        select(Event.occurred_at, Event.details, Event.message)
        .where(Event.run_id == run_id, Event.kind == EventKind.CHECKPOINT, Event.source == "agent")
        .order_by(Event.occurred_at.desc(), Event.id.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    at, details, message = row
    details = details if isinstance(details, dict) else {}
    verified = isinstance(details.get("step"), int)
    return {
        "at": at.isoformat(),
        "age_s": round((now - at).total_seconds(), 1),
        "step": details.get("step") if verified else None,
        "label": details.get("label") or message,
        "verified": verified,  # False: a file the batch step found, not one slurmft.train wrote
    }


def _spares_left(session: Session, run: Run, attempt: Attempt | None) -> int | None:
    """Nodes the job still holds beyond the N that train (the allocation the batch step
    reported and the daemon checked), less those taken out of the run (lost, cordoned); None
    before it has reported."""
    if attempt is None:
        return None
    held = set(
        session.scalars(
            select(AllocationNode.node).where(
                AllocationNode.attempt_id == attempt.id, AllocationNode.left_at.is_(None)
            )
        )
    )
    if not held:
        return None
    usable = held - denied_nodes(session, run_id=run.id)
    return max(len(usable) - run.nodes, 0)


def _effective(session: Session, run_id: str) -> dict[str, Any] | None:
    """The run's row of the `run_effective_time` view (docs/failure-history.md)."""
    row = session.execute(
        text("SELECT wall_s, lost_s, effective_ratio FROM run_effective_time WHERE run_id = :r"),
        {"r": run_id},
    ).first()
    if row is None or row.wall_s is None:  # no span to measure (an ended run with no end time)
        return None
    wall_s, lost_s, ratio = row
    return {
        "wall_s": round(float(wall_s), 1),
        "lost_s": round(float(lost_s), 1),
        "ratio": None if ratio is None else round(float(ratio), 4),
    }


def _doing(session: Session, run: Run, attempt: Attempt | None, progress: Progress) -> str:
    """What slurmft is doing for the run now, in words."""
    if run.state.is_terminal:
        return f"nothing: the run ended ({run.state.value})"
    pending = session.scalars(
        select(Action)
        .where(Action.run_id == run.id, Action.status == ActionStatus.PLANNED)
        .order_by(Action.id.desc())
        .limit(1)
    ).first()
    if pending is not None:
        return f"{pending.kind.value}{f' {pending.node}' if pending.node else ''}: {pending.reason}"
    if run.cancel_requested_at is not None:
        return "cancelling the job"
    if attempt is None or attempt.started_at is None:
        job = attempt.slurm_job_id if attempt is not None else None
        return f"waiting for Slurm to start job {job}" if job else "waiting for a job to watch"
    if run.state is RunState.RECOVERING:
        latest = session.scalars(
            select(Action).where(Action.run_id == run.id).order_by(Action.id.desc()).limit(1)
        ).first()
        after = f" after {latest.kind.value}: {latest.reason}" if latest else ""
        return f"recovering{after}"
    if progress.world_size is None:
        return "watching the nodes (the script reports no steps: node-level supervision)"
    return f"watching {progress.world_size} ranks"


@dataclass(frozen=True)
class _Read:
    """What both `summary` and `status` read from the store, read once."""

    attempt: Attempt | None
    progress: Progress
    effective: dict[str, Any] | None

    @classmethod
    def of(cls, session: Session, run: Run) -> _Read:
        return cls(latest_attempt(session, run.id), _progress(session, run.id),
                   _effective(session, run.id))  # fmt: skip


def summary(session: Session, run: Run, now: datetime, restart_cap: int) -> dict[str, Any]:
    """The fields of `slurmft runs` (and the top of `status`)."""
    return _summary(session, run, restart_cap, _Read.of(session, run))


def _summary(session: Session, run: Run, restart_cap: int, read: _Read) -> dict[str, Any]:
    attempt, progress, effective = read.attempt, read.progress, read.effective
    return {
        "run_id": run.id,
        "name": run.name,
        "owner": run.owner_name,
        "state": run.state.value,
        "nodes": run.nodes,
        "spares": run.spares,
        "job_id": attempt.slurm_job_id if attempt else None,
        "attempts": attempt.number if attempt else 0,
        "created_at": run.created_at.isoformat(),
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "ended_at": run.ended_at.isoformat() if run.ended_at else None,
        "end_reason": run.end_reason,
        "cancel_requested": run.cancel_requested_at is not None,
        "step": progress.step,
        "world_size": progress.world_size,
        "restarts": run.restarts_without_progress,
        "restart_cap": restart_cap,
        "effective_ratio": effective["ratio"] if effective else None,
        "spares_left": _spares_left(session, run, attempt),
    }


def status(session: Session, run: Run, now: datetime, restart_cap: int) -> dict[str, Any]:
    """`slurmft status RUN`: the summary and what `runs` leaves out."""
    read = _Read.of(session, run)
    heartbeat_at = read.progress.heartbeat_at
    return {
        **_summary(session, run, restart_cap, read),
        "last_heartbeat_at": heartbeat_at.isoformat() if heartbeat_at else None,
        "checkpoint": _checkpoint(session, run.id, now),
        "effective": read.effective,
        "doing": _doing(session, run, read.attempt, read.progress),
        "control_failures": run.control_failures,
        "control_error": run.control_error,
        "held": is_held(run),
    }
