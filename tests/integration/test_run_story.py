"""`slurmft runs`, `status` and `events` as the daemon answers them, from a store on SQLite and
on PostgreSQL: the figures come from what the store holds, the timeline is in time order with
repeated reports counted once, and a follower's cursor misses nothing and repeats nothing."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from support.slurm_recordings import RecordedCluster

from slurmft.controller.rpc import Operation, RpcError
from slurmft.controller.user_ops import operations
from slurmft.db import Database
from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    AllocationNode,
    Attempt,
    DenylistEntry,
    Event,
    EventKind,
    NodeRole,
    RankHeartbeat,
    Run,
)
from slurmft.db.states import RunState
from slurmft.slurm.cli_backend import CliSlurmClient

ALICE, BOB = 15001, 15002
T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def _ops(database: Database) -> dict[str, Operation]:
    slurm = CliSlurmClient(RecordedCluster(["show_job_running"]))
    return operations(database, slurm=slurm, restart_cap=5)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _seed_progress(database: Database, seed_run: Callable[..., None]) -> None:
    """Run "ra": 3 nodes + 1 spare, 6 ranks, one of which went quiet a round ago; a checkpoint
    at step 40; its job holds all 4 nodes; 2 restarts without progress."""
    seed_run(database, "ra", job_id="101", owner_uid=ALICE, owner_name="alice", name="alice-run",
             started_at=_at(0), restarts_without_progress=2)  # fmt: skip
    with database.session() as s:
        attempt = s.query(Attempt).filter_by(run_id="ra").one()
        attempt.started_at = _at(1)
        for node in ("n1", "n2", "n3", "n4"):
            role = NodeRole.SPARE if node == "n4" else NodeRole.ACTIVE
            attempt.nodes.append(AllocationNode(node=node, role=role, joined_at=_at(1)))
        for rank in range(6):
            old = rank == 5  # a rank of an earlier round: not in today's world
            s.add(RankHeartbeat(run_id="ra", rank=rank, attempt_id=attempt.id, node="n1",
                                phase="step", step=12 if old else 48, seq=rank,
                                sent_at=_at(-200 if old else 300)))  # fmt: skip
        s.add(Event(run_id="ra", kind=EventKind.CHECKPOINT, source="agent", rank=0,
                    message="checkpoint_saved", details={"step": 40},
                    occurred_at=_at(280)))  # fmt: skip


def test_status_says_where_the_run_is(
    database: Database, seed_run: Callable[..., None]
) -> None:
    _seed_progress(database, seed_run)
    status = _ops(database)["status"](ALICE, {"run_id": "ra"})
    assert (status["step"], status["world_size"]) == (48, 5)
    assert (status["restarts"], status["restart_cap"]) == (2, 5)
    assert (status["spares"], status["spares_left"]) == (1, 1)
    checkpoint = status["checkpoint"]
    assert (checkpoint["step"], checkpoint["verified"]) == (40, True)
    assert checkpoint["age_s"] > 0
    assert status["effective"]["ratio"] == status["effective_ratio"] == 1.0  # nothing lost yet
    assert status["doing"] == "watching 5 ranks"

    with database.session() as s:  # n3 is lost and kept out of the run: no spare left
        s.add(DenylistEntry(node="n3", run_id="ra", reason="slurmft: node n3 lost"))
        s.add(Action(run_id="ra", kind=ActionKind.REQUEUE, reason="batch host n1 lost",
                     status=ActionStatus.PLANNED))  # fmt: skip
    status = _ops(database)["status"](ALICE, {"run_id": "ra"})
    assert status["spares_left"] == 0
    assert status["doing"] == "requeue: batch host n1 lost"


def test_a_plain_script_has_no_step_and_says_so(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "rp", job_id="102", started_at=_at(0))
    with database.session() as s:
        s.query(Attempt).filter_by(run_id="rp").one().started_at = _at(1)
        s.add(Event(run_id="rp", kind=EventKind.CHECKPOINT, source="agent",
                    message="checkpoint epoch_3", occurred_at=_at(50),
                    details={"layout": "files", "ordinal": 3, "label": "epoch_3"}))  # fmt: skip
    status = _ops(database)["status"](0, {"run_id": "rp"})
    assert (status["step"], status["world_size"]) == (None, None)
    assert (status["checkpoint"]["label"], status["checkpoint"]["verified"]) == ("epoch_3", False)
    assert status["doing"].startswith("watching the nodes")


def test_runs_filter_by_state_time_and_user(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "ra", job_id="1", owner_uid=ALICE, owner_name="alice", created_at=_at(0))
    seed_run(database, "rb", job_id="2", owner_uid=BOB, owner_name="bob", created_at=_at(100))
    seed_run(database, "rc", job_id="3", owner_uid=ALICE, owner_name="alice", created_at=_at(200))
    with database.session() as s:
        run = s.get(Run, "rc")
        assert run is not None
        run.state = RunState.COMPLETED
    runs = _ops(database)["runs"]

    def ids(uid: int, **args: Any) -> list[str]:
        return [r["run_id"] for r in runs(uid, args)]

    assert ids(ALICE) == ["rc", "ra"]  # her own, newest first
    assert ids(ALICE, states=["running"]) == ["ra"]
    assert ids(ALICE, since=_at(150).isoformat()) == ["rc"]
    assert ids(0) == ["rc", "rb", "ra"]  # root: everyone's
    assert ids(0, user="bob") == ["rb"]
    assert ids(0, states=["completed", "running"], since=_at(50).isoformat()) == ["rc", "rb"]
    with pytest.raises(RpcError, match="only an admin may list another user's runs"):
        runs(ALICE, {"user": "bob"})
    with pytest.raises(RpcError, match="states must be among"):
        runs(ALICE, {"states": ["sleeping"]})
    with pytest.raises(RpcError, match="not an ISO 8601 time"):
        runs(ALICE, {"since": "yesterday"})
    line = runs(ALICE, {"states": ["running"]})[0]
    assert (line["restarts"], line["restart_cap"], line["step"]) == (0, 5, None)


def _seed_story(database: Database, seed_run: Callable[..., None]) -> None:
    """A node lost, every survivor's agent reporting the restart it caused, the daemon's
    exclusion in between (recorded later than the reports, but decided at 21 s)."""
    seed_run(database, "rs", job_id="7")
    with database.session() as s:
        s.add(Event(run_id="rs", kind=EventKind.NODE_LOST, node="n2", occurred_at=_at(20),
                    message="Slurm: n2 not responding"))  # fmt: skip
        s.add(Action(run_id="rs", kind=ActionKind.DENYLIST_ADD, node="n2", created_at=_at(21),
                     reason="n2 lost", status=ActionStatus.DONE))  # fmt: skip
        for i, node in enumerate(("n1", "n3", "n4")):
            s.add(Event(run_id="rs", kind=EventKind.RESTART, source="agent", node=node,
                        occurred_at=_at(24 + i),
                        message="workers restarted (round 1 -> 2)"))  # fmt: skip
        for step, at in ((60, 90), (70, 100)):  # two checkpoints: two lines, not one "x2"
            s.add(Event(run_id="rs", kind=EventKind.CHECKPOINT, source="agent", rank=0,
                        message="checkpoint_saved", details={"step": step},
                        occurred_at=_at(at)))  # fmt: skip


def test_events_are_one_timeline_with_repeated_reports_counted_once(
    database: Database, seed_run: Callable[..., None]
) -> None:
    _seed_story(database, seed_run)
    told = _ops(database)["events"](0, {"run_id": "rs"})
    lines = [(e["source"], e["kind"], e["count"], tuple(e["nodes"])) for e in told["entries"]]
    assert lines == [
        ("event", "node_lost", 1, ("n2",)),
        ("action", "denylist_add", 1, ("n2",)),
        ("event", "restart", 3, ("n1", "n3", "n4")),
        ("event", "checkpoint", 1, ()),
        ("event", "checkpoint", 1, ()),
    ]
    assert told["entries"][1]["status"] == "done" and not told["truncated"]


def test_a_follower_gets_each_new_entry_once(
    database: Database, seed_run: Callable[..., None]
) -> None:
    _seed_story(database, seed_run)
    events = _ops(database)["events"]
    first = events(0, {"run_id": "rs", "limit": 2})
    assert first["truncated"]  # the newest two of each: the first restart report left out
    assert [e["kind"] for e in first["entries"]] == ["denylist_add", "checkpoint", "checkpoint"]
    cursor = first["cursor"]
    assert events(0, {"run_id": "rs", "cursor": cursor})["entries"] == []
    with database.session() as s:
        # Reported late, by a node whose clock is behind: after the cursor all the same.
        s.add(Event(run_id="rs", kind=EventKind.HANG, node="n3", rank=4, occurred_at=_at(5),
                    message="rank 4 silent 30 s"))  # fmt: skip
    later = events(0, {"run_id": "rs", "cursor": cursor})
    assert [(e["kind"], e["ranks"]) for e in later["entries"]] == [("hang", [4])]
    assert events(0, {"run_id": "rs", "cursor": later["cursor"]})["entries"] == []
    with pytest.raises(RpcError, match="cursor"):
        events(0, {"run_id": "rs", "cursor": {"event_id": -1, "action_id": 0}})
