"""Attempts in a real store as Slurm requeues a job: seen by squeue (no restart count) and by
scontrol (with one)."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select

from slurmft.controller.reconcile import reconcile
from slurmft.db import Database
from slurmft.db.models import Attempt, Run, utcnow
from slurmft.db.states import AttemptState
from slurmft.slurm.api import JobInfo
from slurmft.slurm.states import JobState


def _pass(database: Database, job: JobInfo) -> list[tuple[int, AttemptState, int]]:
    with database.session() as s:
        run = s.get(Run, "r1")
        assert run is not None
        attempts = s.scalars(select(Attempt).order_by(Attempt.number)).all()
        reconcile(s, {"r1": (run, attempts[-1])}, {"7": job}, now=utcnow())
    with database.session() as s:
        return [
            (a.number, a.state, a.slurm_restarts)
            for a in s.scalars(select(Attempt).order_by(Attempt.number))
        ]


def test_a_requeue_seen_first_by_squeue_opens_one_attempt_not_two(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    with database.session() as s:
        first = s.scalars(select(Attempt)).one()
        first.state, first.slurm_restarts = AttemptState.RUNNING, 2  # requeued twice before
    # squeue: the job waits again, restart count unknown (0).
    waiting = _pass(database, JobInfo("7", JobState.PENDING, restarts=0))
    assert waiting == [(1, AttemptState.REQUEUED, 2), (2, AttemptState.SUBMITTED, 3)]
    # scontrol: running again after its third requeue: the same attempt, now running.
    running = _pass(database, JobInfo("7", JobState.RUNNING, nodes=("n7",), restarts=3))
    assert running == [(1, AttemptState.REQUEUED, 2), (2, AttemptState.RUNNING, 3)]
