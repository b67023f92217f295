"""`slurmft nodes` and `slurmft nodes release` as real users, against the root daemon and the
local Slurm cluster.

n6 was drained by slurmft (its drain action and denylist entry recorded, for one of bob's runs,
and Slurm's reason is slurmft's); n5 was drained by someone else. alice lists the nodes: she
sees both drains and who made them, n6's denylist entry without bob's run id, and n5's failure
count. Her release of n6 is refused. root's release of n6 ends the entry and resumes the node;
root's release of n5 leaves that drain as it is. n4 was set DOWN by slurmft (a silent node taken
out of a GPU job before its requeue; its slurmd killed): root's release resumes it too. Every
step is an action row with its reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from daemon_process import DaemonProcess, run_slurmft, running_daemon, slurmft
from local_cluster import Cluster
from sqlalchemy import select
from unix_users import TestUsers

from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, EventKind, FaultClass, Run
from slurmft.db.records import denied_nodes, denylist_add, finish_action, plan_action, record_event
from slurmft.db.states import RunState

pytestmark = [pytest.mark.users, pytest.mark.slurm]

OURS, THEIRS, FENCED = "n6", "n5", "n4"
OUR_REASON = "slurmft: Xid 79 GPU has fallen off the bus (GPU 3)"
FENCE_REASON = "slurmft: node n4 silent (slurmd not responding): DOWN so that GPU job 9 is requeued"


@pytest.fixture
def root_daemon(tmp_path: Path, open_dir: Path) -> Iterator[DaemonProcess]:
    with ExitStack() as stack:
        yield stack.enter_context(
            running_daemon(tmp_path, SLURMFT_PATHS_RUNTIME_DIR=str(open_dir / "run"))
        )


def _seed(database: Database, bob_uid: int) -> None:
    """What the daemon records when it drains a node for a run's GPU fault."""
    with database.session() as s:
        s.add(Run(id="bobs-run", name="b", owner_uid=bob_uid, owner_name="slurmft-bob",
                  nodes=2, spares=0, command=["x"], checkpoint_dir="/tmp",
                  state=RunState.COMPLETED))  # fmt: skip
        s.flush()
        record_event(s, EventKind.GPU_FAULT, "Xid 79", run_id="bobs-run", node=THEIRS,
                     source="agent", fault_class=FaultClass.HARDWARE, foreign=False)  # fmt: skip
        drain = plan_action(s, ActionKind.DRAIN_NODE, OUR_REASON, run_id="bobs-run", node=OURS)
        finish_action(drain, ActionStatus.DONE)
        denylist_add(s, OURS, OUR_REASON, action_id=drain.id)
        denylist_add(s, OURS, "slurmft: straggler", run_id="bobs-run")
        fence = plan_action(s, ActionKind.EVICT_NODE, FENCE_REASON, run_id="bobs-run", node=FENCED)
        finish_action(fence, ActionStatus.DONE)


def _nodes(daemon: DaemonProcess, user: Any) -> dict[str, dict[str, Any]]:
    done = run_slurmft(daemon.client_env(), "nodes", "--json", as_user=user)
    assert done.returncode == 0, done.stderr
    return {row["node"]: row for row in json.loads(done.stdout)["nodes"]}


def test_nodes_lists_drains_denylist_and_failures_and_only_admins_release(
    cluster: Cluster, root_daemon: DaemonProcess, test_users: TestUsers
) -> None:
    env = root_daemon.env
    database = Database(f"sqlite:///{env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    _seed(database, test_users.bob.uid)
    cluster.drain(OURS, OUR_REASON)
    cluster.drain(THEIRS, "maintenance: new DIMMs")
    cluster.kill_node(FENCED)  # silent: DOWN sticks only there (ReturnToService=2 here)
    cluster.client.down(FENCED, FENCE_REASON)

    seen = _nodes(root_daemon, test_users.alice)
    ours, theirs = seen[OURS], seen[THEIRS]
    assert set(seen) >= {"n1", "n2", "n3", "n4", OURS, THEIRS}
    assert ours["drain"]["reason"] == OUR_REASON and ours["drain"]["by_slurmft"] is True
    assert ours["drain"]["by"] == "root" and ours["drain"]["at"]
    assert theirs["drain"]["by_slurmft"] is False
    assert {(e["scope"], e["run_id"]) for e in ours["denylist"]} == {
        ("all runs", None),
        ("run", "another user's run"),  # bob's run, not alice's to see
    }
    assert theirs["failures"]["failures"] == 1 and theirs["lemon"]["is_lemon"] is False
    assert {e["run_id"] for e in _nodes(root_daemon, test_users.bob)[OURS]["denylist"]} == {
        None,
        "bobs-run",
    }

    refused = run_slurmft(root_daemon.client_env(), "nodes", "release", OURS,
                          as_user=test_users.alice)  # fmt: skip
    assert refused.returncode != 0 and "only an admin" in refused.stderr
    assert cluster.client.node(OURS).status.drain_requested  # untouched

    released = json.loads(slurmft(env, "nodes", "release", OURS, "--json"))
    assert released == {
        "node": OURS, "denylist_entries_ended": 2, "resumed": True, "why": "resumed"
    }  # fmt: skip
    assert not cluster.client.node(OURS).status.drain_requested
    left = json.loads(slurmft(env, "nodes", "release", THEIRS, "--json"))
    assert left["resumed"] is False and "someone else" in left["why"]
    assert cluster.client.node(THEIRS).status.drain_requested
    fenced = json.loads(slurmft(env, "nodes", "release", FENCED, "--json"))
    assert (fenced["resumed"], fenced["why"]) == (True, "resumed"), fenced
    assert not cluster.client.node(FENCED).status.down
    with database.session() as s:
        assert denied_nodes(s, run_id="bobs-run") == frozenset()
        released_rows = s.scalars(
            select(Action)
            .where(Action.kind.in_([ActionKind.DENYLIST_REMOVE, ActionKind.RESUME_NODE]))
            .order_by(Action.id)
        )
        rows = [(a.kind, a.node, a.status, a.reason) for a in released_rows]
    assert rows == [
        (ActionKind.DENYLIST_REMOVE, OURS, ActionStatus.DONE,
         "released by root: 2 denylist entries ended"),
        (ActionKind.RESUME_NODE, OURS, ActionStatus.DONE, "released by root: resumed"),
        (ActionKind.DENYLIST_REMOVE, THEIRS, ActionStatus.DONE,
         "released by root: 0 denylist entries ended"),
        (ActionKind.DENYLIST_REMOVE, FENCED, ActionStatus.DONE,
         "released by root: 0 denylist entries ended"),
        (ActionKind.RESUME_NODE, FENCED, ActionStatus.DONE, "released by root: resumed"),
    ]  # fmt: skip

    # The failure history and a run's report, for an ordinary user, through the daemon.
    cli = root_daemon.client_env()
    views = {
        view: run_slurmft(cli, "history", "show", view, "--json", as_user=test_users.alice)
        for view in ("failures_by_node", "run_failures")
    }
    assert all(done.returncode == 0 for done in views.values()), views
    assert [r["node"] for r in json.loads(views["failures_by_node"].stdout)] == [THEIRS]
    assert json.loads(views["run_failures"].stdout) == []  # bob's run is not hers
    bobs = json.loads(
        run_slurmft(cli, "history", "show", "run_failures", "--json", as_user=test_users.bob).stdout
    )
    assert [r["run_id"] for r in bobs] == ["bobs-run"]
    report = run_slurmft(cli, "report", "bobs-run", "--json", as_user=test_users.alice)
    assert report.returncode != 0 and "no run bobs-run visible to you" in report.stderr
    database.dispose()
