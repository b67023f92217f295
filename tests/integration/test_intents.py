"""The intent is durable before the effect (issue 14, item 8), against a real store (SQLite and
PostgreSQL): a daemon killed between sbatch and its commit leaves a planned row, and the next
pass adopts the job that row submitted instead of submitting another. The same through the
real daemon and the real local cluster: tests/integration/slurm/test_intent_e2e.py."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from slurmft.controller import views as v
from slurmft.controller.act import Executor
from slurmft.controller.intents import INTERRUPTED, NOT_SUBMITTED, settle_interrupted
from slurmft.controller.observe import _reported_keys
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Attempt, EventKind, Run
from slurmft.db.records import record_event
from slurmft.db.states import AttemptState, RunState
from slurmft.slurm.api import JobInfo
from slurmft.slurm.script import comment_for_run
from slurmft.slurm.states import JobState


class Killed(BaseException):
    """The daemon's process ending where it stands (what SIGKILL does to the executor)."""


class TaggedJobs:
    """Slurm's view of one user's jobs, as ``jobs_of_user`` answers it; records the asks."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobInfo] = {}
        self.asked: list[int] = []

    def submit(self, run_id: str, action_id: int) -> str:
        job_id = str(100 + len(self.jobs))
        comment = comment_for_run(run_id, action_id)
        self.jobs[job_id] = JobInfo(job_id, JobState.PENDING, comment=comment, user_id=0)
        return job_id

    def jobs_of_user(self, uid: int) -> dict[str, JobInfo]:
        self.asked.append(uid)
        return dict(self.jobs)


def _killed_after_sbatch(slurm: TaggedJobs) -> Callable[[Run, frozenset[str], int], str]:
    def submit(run: Run, exclude: frozenset[str], action_id: int) -> str:
        slurm.submit(run.id, action_id)
        raise Killed  # sbatch answered; the daemon dies before it records the job

    return submit


def _resubmit(run_id: str) -> v.SubmitAttempt:
    return v.SubmitAttempt(
        run_id, "job 7 ended (time_limit)", exclude=frozenset(), restarts_without_progress=2
    )


def test_a_daemon_killed_after_sbatch_leaves_a_planned_row_and_the_next_pass_adopts_the_job(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r2", job_id="7")
    slurm = TaggedJobs()
    executor = Executor(database, slurm, submit_attempt=_killed_after_sbatch(slurm))  # type: ignore[arg-type]
    with pytest.raises(Killed):
        executor.execute([_resubmit("r2")])

    with database.session() as s:
        (row,) = s.scalars(select(Action)).all()
        # The intent survived the kill: the next pass knows a job may exist.
        assert (row.kind, row.status) == (ActionKind.RESUBMIT, ActionStatus.PLANNED)
        assert [a.slurm_job_id for a in s.scalars(select(Attempt))] == ["7"]
        action_id = row.id

    with database.session() as s:
        assert settle_interrupted(s, slurm) == 1  # type: ignore[arg-type]
    assert slurm.asked == [0]  # the run owner's jobs, one call

    with database.session() as s:
        row = s.get(Action, action_id)
        assert row is not None and row.status is ActionStatus.DONE
        (job_id,) = slurm.jobs
        assert row.evidence["slurm_job_id"] == job_id and row.evidence["adopted"] is True
        attempts = s.scalars(select(Attempt).order_by(Attempt.number)).all()
        assert [(a.number, a.slurm_job_id) for a in attempts] == [(1, "7"), (2, job_id)]
        assert attempts[1].state is AttemptState.SUBMITTED
        run = s.get(Run, "r2")
        assert run is not None and run.state is RunState.RECOVERING
        assert run.restarts_without_progress == 2  # charged as if recorded at once

    with database.session() as s:  # settled once: a later pass has nothing to settle
        assert settle_interrupted(s, slurm) == 0  # type: ignore[arg-type]


def test_an_interrupted_effect_without_a_tagged_job_fails_and_is_decided_again(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r3", job_id="7")
    slurm = TaggedJobs()

    def killed_before_sbatch(run: Run, exclude: frozenset[str], action_id: int) -> str:
        raise Killed

    class KilledDraining(TaggedJobs):
        def drain(self, node: str, reason: str) -> None:
            raise Killed

    executor = Executor(database, slurm, submit_attempt=killed_before_sbatch)  # type: ignore[arg-type]
    with pytest.raises(Killed):
        executor.execute([_resubmit("r3")])
    with database.session() as s:  # the run's own evidence names n2: the drain goes ahead
        record_event(s, EventKind.GPU_FAULT, "Xid 79", run_id="r3", node="n2", foreign=False)
    with pytest.raises(Killed):
        Executor(database, KilledDraining()).execute(  # type: ignore[arg-type]
            [v.DrainNode("r3", "xid 79", {"key": "gpu:n2:79"}, node="n2")]
        )

    with database.session() as s:
        assert settle_interrupted(s, slurm) == 2  # type: ignore[arg-type]
    with database.session() as s:
        rows = s.scalars(select(Action).order_by(Action.id)).all()
        assert [(a.kind, a.status, a.error) for a in rows] == [
            (ActionKind.RESUBMIT, ActionStatus.FAILED, NOT_SUBMITTED),
            (ActionKind.DRAIN_NODE, ActionStatus.FAILED, INTERRUPTED),
        ]
        assert [a.slurm_job_id for a in s.scalars(select(Attempt))] == ["7"]
        run = s.get(Run, "r3")
        assert run is not None and run.restarts_without_progress == 0  # no job, no charge
        # Decided again at once, not after the retry delay of a drain that failed.
        since = datetime(2020, 1, 1, tzinfo=UTC)
        assert _reported_keys(s, "r3", since, now=datetime.now(UTC)) == frozenset()


def test_agent_commands_and_webhook_notices_stay_planned(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r4", job_id="7")
    slurm = TaggedJobs()
    Executor(database, slurm, webhook=True).execute(  # type: ignore[arg-type]
        [v.RestartWorkers("r4", "hung", node="n1"), v.NotifyHuman("r4", "look at n2")]
    )
    with database.session() as s:
        assert settle_interrupted(s, slurm) == 0  # type: ignore[arg-type]
    with database.session() as s:
        statuses = s.scalars(select(Action.status)).all()
        assert statuses == [ActionStatus.PLANNED, ActionStatus.PLANNED]
    assert slurm.asked == []  # nothing to settle: Slurm is not asked
