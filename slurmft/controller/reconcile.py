"""Keeping the store's runs and attempts in step with what Slurm says about their jobs.

``attempt_change`` is pure (Slurm's job record in, the bookkeeping to do out); ``reconcile``
applies it. An attempt is one Slurm job submission *or one requeue of it*: when Slurm's restart
count for the job rises, the current attempt ended REQUEUED and the next one begins with the
same job id. Nothing here decides a recovery: that is ``decide``'s; this only records facts.

The run's restart budget is not one of them: gather reads what the run went through
(slurmft.controller.restarts), decide counts it, act records the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from slurmft.controller.pass_health import PassFailures
from slurmft.db.models import Attempt, Run
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
    failures: PassFailures | None = None,
) -> None:
    """Apply Slurm's view of every tracked job to its run and attempts. A run whose record
    cannot be applied (bad data, a bug) gets the error recorded on it (and in ``failures``);
    the others go on."""
    for run, attempt in runs.values():
        if attempt is None or attempt.slurm_job_id is None or attempt.slurm_job_id not in jobs:
            continue
        try:
            _reconcile_run(session, run, attempt, jobs[attempt.slurm_job_id], now)
        except SQLAlchemyError:
            raise  # the store's failure, not this run's: the pass is skipped for everyone
        except Exception as exc:
            (failures or PassFailures()).record(session, run.id, "reconciling with Slurm", exc)
    session.flush()


def _reconcile_run(
    session: Session, run: Run, attempt: Attempt, job: JobInfo, now: datetime
) -> None:
    # Everything that may fail is worked out before the first write to the run's rows.
    restarts = attempt.slurm_restarts
    if job.restarts > restarts and attempt.state is AttemptState.SUBMITTED:
        restarts = job.restarts  # requeued before it was ever seen running
    change = attempt_change(run.state, attempt.state, restarts, job)
    attempt.slurm_restarts = restarts
    current = _next_attempt(session, attempt, job, now) if change.requeued else attempt
    _apply(current, change.state, job, now)
    if change.run_state is not None:
        run.state = change.run_state
        if change.run_state is RunState.RUNNING and run.started_at is None:
            run.started_at = now


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
