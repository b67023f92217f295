"""observe → decide → act on the real local Slurm cluster: a node of a running --no-kill job is
killed; the controller sees it lost, records why, takes it out of the run, and does so once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from local_cluster import Cluster
from sqlalchemy import select
from support.waiting import wait_for_value

from slurmft.controller.act import Executor
from slurmft.controller.decide import Policy, decide
from slurmft.controller.observe import observe
from slurmft.controller.views import ClusterView, ExcludeNode, JobPhase, NodeCondition, RecordEvent
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Attempt, Event, EventKind
from slurmft.db.records import denied_nodes
from slurmft.db.states import AttemptState

pytestmark = pytest.mark.slurm


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    db = Database(f"sqlite:///{tmp_path}/slurmft.db")
    db.upgrade()
    yield db
    db.dispose()


def _observe(database: Database, cluster: Cluster) -> ClusterView:
    with database.session() as session:
        return observe(session, cluster.client, now=datetime.now(UTC))


def test_a_killed_node_is_seen_recorded_and_excluded_once(
    cluster: Cluster, database: Database, seed_run: Callable[..., None]
) -> None:
    job_id = cluster.submit(
        ["sleep", "300"], nodes=3, spare_nodes=1, run_id="rloop", ntasks_per_node=1
    )
    job, _ = cluster.wait_running(job_id)
    seed_run(database, "rloop", job_id=job_id)
    policy = Policy()

    healthy = _observe(database, cluster)
    (run_view,) = healthy.runs
    assert run_view.job is not None and run_view.job.phase is JobPhase.ACTIVE
    assert {n.name for n in run_view.nodes} == set(job.nodes)
    assert decide(healthy, policy) == []
    with database.session() as s:  # observe recorded what Slurm says
        attempt = s.scalars(select(Attempt)).one()
        assert attempt.state is AttemptState.RUNNING and attempt.batch_host == job.batch_host
        assert attempt.nodelist is not None and set(attempt.nodelist.split(",")) == set(job.nodes)

    victim = next(n for n in job.nodes if n != job.batch_host)
    cluster.kill_node(victim)
    view, seconds = wait_for_value(
        f"{victim} lost",
        lambda: _observe(database, cluster),
        lambda v: any(
            n.name == victim and n.condition is NodeCondition.LOST for n in v.runs[0].nodes
        ),
    )
    actions = decide(view, policy)
    assert [type(a) for a in actions] == [RecordEvent, ExcludeNode]
    assert all(victim in a.reason for a in actions)
    Executor(database, cluster.client).execute(actions)

    with database.session() as s:
        (event,) = s.scalars(select(Event)).all()
        assert (event.kind, event.node) == (EventKind.NODE_LOST, victim)
        (action,) = s.scalars(select(Action)).all()
        assert (action.kind, action.node, action.status) == (
            ActionKind.AGENT_LEAVE,
            victim,
            ActionStatus.DONE,
        )
        assert victim in denied_nodes(s, run_id="rloop")
    again = _observe(database, cluster)
    assert decide(again, policy) == []  # recorded once, excluded once
    assert again.runs[0].job is not None and again.runs[0].job.phase is JobPhase.ACTIVE
    print(f"kill -> controller sees {victim} lost: {seconds:.1f} s")
