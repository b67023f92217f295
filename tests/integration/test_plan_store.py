"""`slurmft plan --store`: the rates read from a seeded store's history views (SQLite and
PostgreSQL), and the refusal to plan from too little history."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from slurmft.db import Database
from slurmft.db.history import planning_counts
from slurmft.db.models import AllocationNode, Attempt, Event, EventKind, FaultClass, NodeRole, Run
from slurmft.db.states import RunState
from slurmft.sim.inputs import Hit
from slurmft.sim.plan import StoreHistory, TooLittleHistory, rates_from_store
from tests.support.cli import run_cli

T0 = datetime(2026, 11, 1, tzinfo=UTC)
NODES = 32
HOURS = 200.0  # each allocation node held this long: 6,400 node-hours, 200 of them a spare's


def _seed(database: Database, *, gpu: int, lost: int, hangs: int, crashes: int) -> None:
    end = T0 + timedelta(hours=HOURS)
    with database.session() as s:
        run = Run(id="r1", name="big", owner_uid=1000, owner_name="alice", nodes=NODES - 1,
                  spares=1, command=["python", "train.py"])  # fmt: skip
        run.state = RunState.RUNNING
        s.add(run)
        s.flush()
        attempt = Attempt(run_id="r1", number=1, started_at=T0, ended_at=end)
        s.add(attempt)
        s.flush()
        s.add_all(
            AllocationNode(
                attempt_id=attempt.id,
                node=f"n{i}",
                joined_at=T0,
                role=NodeRole.SPARE if i == NODES - 1 else NodeRole.ACTIVE,
                left_at=None if i % 2 else end,
            )
            for i in range(NODES)
        )
        events = [
            *((EventKind.GPU_FAULT, FaultClass.HARDWARE, 79) for _ in range(gpu)),
            *((EventKind.NODE_LOST, FaultClass.HARDWARE, None) for _ in range(lost)),
            *((EventKind.HANG, FaultClass.HANG, None) for _ in range(hangs)),
            *((EventKind.RESTART, FaultClass.USER_CODE, None) for _ in range(crashes)),
            # Neither is a failure of its own: the restart a node loss caused, and progress.
            (EventKind.RESTART, FaultClass.HARDWARE, None),
            (EventKind.CHECKPOINT, None, None),
        ]
        s.add_all(
            Event(
                run_id="r1",
                kind=kind,
                fault_class=fault,
                xid=xid,
                node=f"n{k % NODES}",
                occurred_at=T0 + timedelta(minutes=k),
            )
            for k, (kind, fault, xid) in enumerate(events)
        )


def test_plan_reads_the_store_rates_right(database: Database) -> None:
    _seed(database, gpu=12, lost=6, hangs=2, crashes=5)
    with database.session() as s:
        counts = planning_counts(s, now=T0 + timedelta(days=30))
    # Open allocation rows end with their attempt, not at "now".
    assert counts["node_hours"] == pytest.approx(NODES * HOURS)
    assert counts["failures_by_kind"] == {"gpu_fault": 12, "hang": 2, "node_lost": 6}
    assert counts["user_code_restarts"] == 5
    rates, stragglers = rates_from_store(StoreHistory(**counts))
    node_hours = NODES * HOURS
    assert rates.rate(Hit.GPU) == pytest.approx(12 / node_hours)
    assert rates.rate(Hit.NODE) == pytest.approx(6 / node_hours)
    assert rates.rate(Hit.HANG) == pytest.approx(2 / node_hours)
    assert rates.rate(Hit.SOFTWARE) == pytest.approx(5 / node_hours)
    assert rates.sample_failures == 25 and stragglers == 0.0
    assert "25 failures over 6,400 node-hours" in rates.source


def test_plan_refuses_a_store_with_too_little_history(database: Database) -> None:
    _seed(database, gpu=2, lost=1, hangs=0, crashes=0)
    with database.session() as s:
        counts = planning_counts(s, now=T0 + timedelta(days=30))
    with pytest.raises(TooLittleHistory, match="3 failures over 6,400 node-hours"):
        rates_from_store(StoreHistory(**counts))
    # Enough failures, too few node-hours: refused as well.
    with pytest.raises(TooLittleHistory, match="at least 20 failures and 10,000 node-hours"):
        rates_from_store(StoreHistory(**{**counts, "failures_by_kind": {"gpu_fault": 40}}),
                         min_node_hours=10_000)  # fmt: skip



def test_plan_command_on_the_store(
    database: Database, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"database.url={store_url}"
    _seed(database, gpu=2, lost=1, hangs=0, crashes=0)
    code, _, err = run_cli(capsys, "--set", store, "plan", "--gpus", "512", "--store")
    assert code != 0
    assert "slurmft: error: the store holds 3 failures" in err
    with database.session() as s:
        s.add_all(
            Event(
                run_id="r1",
                kind=EventKind.GPU_FAULT,
                fault_class=FaultClass.HARDWARE,
                node="n3",
                occurred_at=T0 + timedelta(hours=k),
            )
            for k in range(30)
        )
    code, out, err = run_cli(capsys, "--set", store, "plan", "--gpus", "512", "--store",
                          "--seeds", "2", "--days", "1", "--json", "--workers", "1")  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["rates"]["source"] == "store: 33 failures over 6,400 node-hours"
    assert plan["rates"]["per_node_hour"] == pytest.approx(33 / 6400)
    low, high = plan["rates"]["per_node_hour_ci95"]
    assert low < 33 / 6400 < high
    assert plan["recommended"]["spares"] in {c["spares"] for c in plan["spare_choices"]}
