"""A node lost as the batch step requeued its job: the requeued attempt's nodes that Slurm calls
lost are the waiting job's nodes, so the daemon still records the loss (observe + decide)."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select

from slurmft.controller.observe import _lost_by_requeue
from slurmft.controller.views import NodeCondition
from slurmft.db import Database
from slurmft.db.models import Attempt
from slurmft.db.states import AttemptState
from slurmft.slurm.api import NodeInfo
from slurmft.slurm.states import parse_node_state

NODES = {
    "n1": NodeInfo("n1", parse_node_state("IDLE")),
    "n2": NodeInfo("n2", parse_node_state("DOWN*")),
    # n3: Slurm no longer reports it at all
}


def _attempts(database: Database, first: AttemptState, nodelist: str | None) -> Attempt:
    with database.session() as s:
        (requeued,) = s.scalars(select(Attempt)).all()
        requeued.state, requeued.nodelist = AttemptState.RUNNING, nodelist
        requeued.state = first
        waiting = Attempt(run_id="r1", number=2, slurm_job_id="7", state=AttemptState.SUBMITTED)
        s.add(waiting)
        s.flush()
        s.expunge(waiting)
        return waiting


def test_the_requeued_attempts_lost_nodes_are_the_waiting_jobs(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    waiting = _attempts(database, AttemptState.REQUEUED, "n1,n2,n3")
    with database.session() as s:
        views = _lost_by_requeue(s, s.merge(waiting), NODES)
    assert [(v.name, v.condition) for v in views] == [
        ("n2", NodeCondition.LOST),
        ("n3", NodeCondition.LOST),
    ]


def test_only_after_a_requeue(database: Database, seed_run: Callable[..., None]) -> None:
    seed_run(database, "r1", job_id="7")
    waiting = _attempts(database, AttemptState.FAILED, "n1,n2,n3")  # resubmitted, not requeued
    with database.session() as s:
        assert _lost_by_requeue(s, s.merge(waiting), NODES) == ()
        assert _lost_by_requeue(s, None, NODES) == ()
