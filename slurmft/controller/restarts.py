"""Reading what a run's restart budget is counted from: the store's reports of failures,
restarts, checkpoints, lost nodes and hangs, since the run's newest progress (`RestartEvidence`).
Reads only; ``decide.count_restarts`` counts them and act records the count.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.controller.views import RestartEvidence
from slurmft.core.budget import CAUSE_WINDOW_S, Seen, Sighting, named_round
from slurmft.db.models import Action, ActionKind, Attempt, Event, EventKind, FaultClass, Run
from slurmft.db.states import AttemptState


def restart_evidence(session: Session, run: Run) -> RestartEvidence:
    """The run's restarts in a row since its newest checkpoint first appeared, as reports: in-place
    restarts its agents reported, and its earlier jobs that failed. (The job that failed just
    now is ``decide``'s to charge when it resubmits: it is not read here.)"""
    since = run.last_progress_at or run.created_at
    progress = _progress(session, run.id, since)
    if progress is not None:
        since = progress.at
    window = timedelta(seconds=CAUSE_WINDOW_S)
    return RestartEvidence(
        since=run.last_progress_at or run.created_at,
        progress_at=run.last_progress_at,
        progress=progress,
        restarts=(
            *_restarts(session, run.id, since - window),
            *_failed_jobs(session, run.id, since - window),
        ),
        causes=tuple(_causes(session, run.id, since - 2 * window)),
        recorded=_recorded_restarts(session, run.id),
    )


def _recorded_restarts(session: Session, run_id: str) -> dict[str, tuple[FaultClass | None, bool]]:
    """The daemon's `restart` events of the run: restart key -> (cause, free)."""
    events = session.execute(
        select(Event.fault_class, Event.details).where(
            Event.run_id == run_id, Event.kind == EventKind.RESTART, Event.source == "daemon"
        )
    ).all()
    return {
        str(details["restart_key"]): (cause, bool(details.get("free")))
        for cause, details in events
        if isinstance(details, dict) and "restart_key" in details
    }


def _progress(session: Session, run_id: str, since: datetime) -> Sighting | None:
    """The first report of the newest checkpoint reported since ``since``: the ranks' verified
    checkpoints (a `step`); where there are none, the complete files the batch step found
    (an `ordinal`, slurmft.core.checkpoints), the same rule as the batch step's."""
    rows = session.execute(
        select(Event.recorded_at, Event.details)
        .where(
            Event.run_id == run_id,
            Event.kind == EventKind.CHECKPOINT,
            Event.source == "agent",
            Event.recorded_at >= since,
        )
        .order_by(Event.recorded_at, Event.id)
    ).all()
    verified = [(at, d["step"], "") for at, d in rows if _int(d, "step") is not None]
    files = [(at, d["ordinal"], str(d.get("label") or "")) for at, d in rows if _file(d)]
    best: Sighting | None = None
    for at, step, label in verified or files:
        if best is None or step > best.step:
            best = Sighting(Seen.CHECKPOINT, at, step=step, label=label)
    return best


def _int(details: object, key: str) -> int | None:
    value = details.get(key) if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _file(details: object) -> bool:
    """A checkpoint the batch step found on disk (slurmft.agent.batch.file_checkpoint_event)."""
    has_layout = isinstance(details, dict) and "layout" in details
    return has_layout and _int(details, "ordinal") is not None


def _restarts(session: Session, run_id: str, since: datetime) -> list[Sighting]:
    """Ranks that saw a peer fail, and agents whose workers restarted (see restart_groups)."""
    kinds = {EventKind.COLLECTIVE_ERROR: Seen.FAILURE, EventKind.RESTART: Seen.RESTART}
    rows = session.execute(
        select(Event.kind, Event.recorded_at, Event.rank, Event.details).where(
            Event.run_id == run_id,
            Event.kind.in_(kinds),
            Event.source == "agent",
            Event.recorded_at >= since,
        )
    ).all()
    return [
        Sighting(
            kinds[kind],
            at,
            agent=str(details.get("agent_id", "")),
            rank=rank if rank is not None else -1,
            round=named_round(details),
        )
        for kind, at, rank, details in rows
    ]


def _causes(session: Session, run_id: str, since: datetime) -> list[Sighting]:
    """Nodes lost or taken out of the run, hung workers killed, and numerical faults a re-run
    reproduced (their workers exit under the `stop` policy), since ``since``."""
    kinds = {
        EventKind.NODE_LOST: Seen.NODE_REMOVED,
        EventKind.BATCH_HOST_DOWN: Seen.NODE_REMOVED,
        EventKind.HANG: Seen.HANG,
        EventKind.NUMERICAL_FAULT: Seen.NUMERICAL,
    }
    events = session.execute(
        select(Event.kind, Event.recorded_at, Event.source).where(
            Event.run_id == run_id,
            Event.kind.in_(kinds),
            Event.recorded_at >= since,
            # A numerical fault not reproduced is the node's (training went on): no cause.
            (Event.kind != EventKind.NUMERICAL_FAULT)
            | (Event.fault_class == FaultClass.NUMERICAL),
        )
    ).all()
    leaves = session.scalars(
        select(Action.created_at).where(
            Action.run_id == run_id,
            Action.kind == ActionKind.AGENT_LEAVE,
            Action.created_at >= since,
        )
    ).all()
    return [
        # A hang ends when the agent kills the workers: its event, not the daemon's finding.
        *(
            Sighting(kinds[kind], at)
            for kind, at, source in events
            if kind is not EventKind.HANG or source == "agent"
        ),
        *(Sighting(Seen.NODE_REMOVED, at) for at in leaves),
    ]


def _failed_jobs(session: Session, run_id: str, since: datetime) -> list[Sighting]:
    attempts = session.scalars(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)
    ).all()
    return [
        Sighting(Seen.JOB_FAILED, a.ended_at)
        for a in attempts[:-1]  # the latest one's failure is still being decided on
        if a.state is AttemptState.FAILED and a.ended_at is not None and a.ended_at >= since
    ]
