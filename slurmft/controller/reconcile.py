"""Keeping the store's runs and attempts in step with what Slurm says about their jobs.

``attempt_change`` is pure (Slurm's job record in, the bookkeeping to do out); ``reconcile``
applies it. An attempt is one Slurm job submission *or one requeue of it*: when Slurm's restart
count for the job rises, the current attempt ended REQUEUED and the next one begins with the
same job id. Nothing here decides a recovery: that is ``decide``'s; this only records facts.

The run's restart budget is one of those facts: ``reconcile_budget`` reads it from what the run
went through (slurmft.core.budget.budget_from_history) into ``restarts_without_progress``,
which ``decide`` compares with the cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.core.budget import (
    CAUSE_WINDOW_S,
    ChargedRestart,
    Seen,
    Sighting,
    budget_from_history,
    charged_restarts,
    named_round,
)
from slurmft.db.models import Action, ActionKind, Attempt, Event, EventKind, Run
from slurmft.db.records import record_event
from slurmft.db.states import ATTEMPT_TRANSITIONS, AttemptState, RunState
from slurmft.slurm.api import JobInfo
from slurmft.slurm.states import JobPhase, JobState

_ENDED: dict[JobState, AttemptState] = {
    JobState.COMPLETED: AttemptState.COMPLETED,
    JobState.TIMEOUT: AttemptState.TIMEOUT,
    JobState.DEADLINE: AttemptState.TIMEOUT,
    JobState.PREEMPTED: AttemptState.PREEMPTED,
    JobState.CANCELLED: AttemptState.CANCELLED,
    JobState.NODE_FAIL: AttemptState.NODE_FAIL,
    JobState.BOOT_FAIL: AttemptState.NODE_FAIL,
}


@dataclass(frozen=True)
class AttemptChange:
    requeued: bool = False  # end this attempt REQUEUED and open the next one
    state: AttemptState | None = None  # the (new) current attempt's state, if it changed
    run_state: RunState | None = None


def attempt_change(
    run_state: RunState, attempt_state: AttemptState, recorded_restarts: int, job: JobInfo
) -> AttemptChange:
    """What Slurm's record of the job means for the run's bookkeeping."""
    # squeue has no restart count: a running attempt whose job is queued again was requeued.
    # (scontrol's Restarts, when the record comes from there, catches a requeue that already
    # runs again; Slurm holds a requeued job for cred_expire, 120 s by default, first.)
    requeued = job.restarts > recorded_restarts or (
        attempt_state is AttemptState.RUNNING and job.state.phase is JobPhase.WAITING
    )
    current = AttemptState.SUBMITTED if requeued else attempt_state
    phase = job.state.phase
    completing = job.state is JobState.COMPLETING
    state: AttemptState | None = None
    # A requeued job still COMPLETING on its old nodes has not started again yet.
    if phase is JobPhase.ACTIVE and current is AttemptState.SUBMITTED and not completing:
        state = AttemptState.RUNNING
    elif phase is JobPhase.ENDED and not current.is_terminal:
        state = _ENDED.get(job.state, AttemptState.FAILED)
    run = _run_state(run_state, requeued, state or current)
    return AttemptChange(requeued, state, run)


def _run_state(run: RunState, requeued: bool, attempt: AttemptState) -> RunState | None:
    if run.is_terminal:
        return None
    if attempt is AttemptState.RUNNING:
        return None if run is RunState.RUNNING else RunState.RUNNING
    if requeued and run is RunState.RUNNING:
        return RunState.RECOVERING
    return None


def reconcile(
    session: Session,
    runs: Mapping[str, tuple[Run, Attempt | None]],
    jobs: Mapping[str, JobInfo],
    *,
    now: datetime,
) -> None:
    """Apply Slurm's view of every tracked job to its run and attempts."""
    for run, attempt in runs.values():
        if attempt is None or attempt.slurm_job_id not in jobs:
            continue
        job = jobs[attempt.slurm_job_id]
        if job.restarts > attempt.slurm_restarts and attempt.state is AttemptState.SUBMITTED:
            attempt.slurm_restarts = job.restarts  # requeued before it was ever seen running
        change = attempt_change(run.state, attempt.state, attempt.slurm_restarts, job)
        current = _next_attempt(session, attempt, job, now) if change.requeued else attempt
        _apply(current, change.state, job, now)
        if change.run_state is not None:
            run.state = change.run_state
            if change.run_state is RunState.RUNNING and run.started_at is None:
                run.started_at = now
    session.flush()
    for run, _ in runs.values():
        if not run.state.is_terminal:
            reconcile_budget(session, run)


def _next_attempt(session: Session, ended: Attempt, job: JobInfo, now: datetime) -> Attempt:
    """Slurm requeued the job: this attempt ended, the next one has the same job id."""
    ended.state = AttemptState.REQUEUED
    ended.ended_at = now
    ended.end_reason = f"requeued by Slurm (restart {job.restarts})"
    following = Attempt(
        run_id=ended.run_id,
        number=ended.number + 1,
        slurm_job_id=ended.slurm_job_id,
        # squeue has no restart count (it reads 0): a requeue seen there as the job waiting
        # again is one more than the ended attempt's. Left at 0, scontrol's real count would
        # later look like yet another requeue and open a spurious attempt.
        slurm_restarts=max(job.restarts, ended.slurm_restarts + 1),
        # Explicit: the column default is applied only at INSERT, and _apply reads it before.
        state=AttemptState.SUBMITTED,
        submitted_at=now,
    )
    session.add(following)
    return following


def _apply(attempt: Attempt, state: AttemptState | None, job: JobInfo, now: datetime) -> None:
    if state is None:
        return
    if state not in ATTEMPT_TRANSITIONS[attempt.state]:
        # It ran and ended between two looks (e.g. while the daemon was down): record both.
        attempt.state = AttemptState.RUNNING
    attempt.state = state
    if state is AttemptState.RUNNING:
        attempt.started_at = now
        attempt.nodelist = ",".join(job.nodes)
        attempt.batch_host = job.batch_host or None
    elif state.is_terminal:
        attempt.ended_at = now
        attempt.end_reason = f"Slurm: {job.state.value} (exit {job.exit_code or '?'})"


def reconcile_budget(session: Session, run: Run) -> None:
    """The run's restarts in a row since its newest checkpoint first appeared, counted from the
    store: in-place restarts its agents reported, and its earlier jobs that failed. (The job that
    failed just now is ``decide``'s to charge when it resubmits: it is not counted here yet.)
    ``last_progress_at`` remembers that checkpoint, so each pass reads only what came after."""
    since = run.last_progress_at or run.created_at
    progress = _progress(session, run.id, since)
    if progress is not None:
        since = run.last_progress_at = progress.at
    window = timedelta(seconds=CAUSE_WINDOW_S)
    # The record also revisits the restarts of the cause window before the newest checkpoint:
    # progress may come seconds after a restart whose node Slurm has not called lost yet. So
    # everything is read from that far back (causes a window further), and the budget takes
    # the part it counts.
    causes = _causes(session, run.id, since - 2 * window)
    recent = [
        *_restarts(session, run.id, since - window),
        *_failed_jobs(session, run.id, since - window),
    ]
    sightings = [
        *([progress] if progress else []),
        *[s for s in recent if s.at >= since],
        *[c for c in causes if c.at >= since - window],
    ]
    # The cap only decides `exhausted`; the count is the same whatever it is.
    run.restarts_without_progress = budget_from_history(sightings, 1).restarts_without_progress
    _record_restarts(session, run.id, charged_restarts([*recent, *causes]))


def _record_restarts(session: Session, run_id: str, restarts: list[ChargedRestart]) -> None:
    """One `restart` event of the daemon's per restart counted, with its cause: what the
    `run_restarts` view counts (the agents' reports of it, one per node, are its evidence). A
    restart is counted at its first report, often before the node loss that caused it is
    known (Slurm takes seconds to call a node DOWN), so a recorded cause is corrected later."""
    if not restarts:
        return
    recorded = {
        event.details.get("restart_key"): event
        for event in session.scalars(
            select(Event).where(
                Event.run_id == run_id, Event.kind == EventKind.RESTART, Event.source == "daemon"
            )
        )
        if isinstance(event.details, dict)
    }
    for restart in restarts:
        free = ", free: its node left the run" if restart.node_removed else ""
        message = f"workers restarted ({restart.cause.value}{free})"
        details = {"restart_key": restart.key, "free": restart.node_removed}
        event = recorded.get(restart.key)
        if event is None:
            record_event(
                session,
                EventKind.RESTART,
                message,
                run_id=run_id,
                fault_class=restart.cause,
                details=details,
                occurred_at=restart.at,
            )
        elif event.fault_class is not restart.cause or event.details != details:
            event.fault_class, event.message, event.details = restart.cause, message, details


def _progress(session: Session, run_id: str, since: datetime) -> Sighting | None:
    """The first report of the newest checkpoint step reported since ``since``."""
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
    best: Sighting | None = None
    for at, details in rows:
        step = details.get("step") if isinstance(details, dict) else None
        if isinstance(step, int) and (best is None or step > best.step):
            best = Sighting(Seen.CHECKPOINT, at, step=step)
    return best


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
    """Nodes lost or taken out of the run, and hung workers killed, since ``since``."""
    kinds = {
        EventKind.NODE_LOST: Seen.NODE_REMOVED,
        EventKind.BATCH_HOST_DOWN: Seen.NODE_REMOVED,
        EventKind.HANG: Seen.HANG,
    }
    events = session.execute(
        select(Event.kind, Event.recorded_at, Event.source).where(
            Event.run_id == run_id, Event.kind.in_(kinds), Event.recorded_at >= since
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
