"""GPU faults on a running job, injected through the GPU probe the way a real driver reports
them to the node's agent.

- Xid 79 (drain class): the daemon drains the node in Slurm with the Xid in the reason,
  denylists it, the agent leaves, a spare takes over at the same world size, later submissions
  exclude the node, and the run completes.
- Xid 13 (restart class): the application restarts; the node is neither drained nor denylisted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import TINY, SubmittedRun, submit
from local_cluster import Cluster
from sqlalchemy import select
from support.waiting import wait_for_value

from slurmft.controller.rpc import call
from slurmft.db.models import ActionKind, ActionStatus, AllocationNode, Event, EventKind, NodeRole
from slurmft.db.records import denied_nodes

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", *TINY]


def _training(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path, name: str
) -> tuple[SubmittedRun, Path]:
    """A 3+1 run whose agents read GPU faults from a file the test writes, once it trains."""
    inject = tmp_path / "gpu-faults"
    inject.write_text("")
    run = submit(
        cluster,
        daemon,
        tmp_path,
        EXAMPLE,
        name=name,
        env={"SLURMFT_GPU_INJECT": str(inject), "SLURMFT_GPU_POLL_INTERVAL_S": "1"},
    )
    run.wait_training()
    return run, inject


def _completes(run: SubmittedRun) -> None:
    run.wait_completed(60)
    assert {r["world_size"] for r in run.jsonl("losses.jsonl")} == {3}


def test_xid_79_drains_the_node_and_a_spare_takes_over(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run, inject = _training(cluster, daemon, tmp_path, "xid79")
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
    cluster._drained.add(victim)  # resumed by the fixture whatever happens
    inject.write_text(f"xid=79,gpu=3,node={victim}\n")

    reason = "slurmft: Xid 79 GPU fell off the bus (GPU 3)"
    wait_for_value(
        "the drain in Slurm",
        lambda: cluster.client.node(victim),
        lambda node: node.status.drain_requested,
        timeout_s=60,
    )
    assert cluster.client.node(victim).reason.startswith(reason)
    run.wait_replaced(victim)
    later = call(
        daemon.socket_path,
        "create_run",
        spec={"name": "later", "nodes": 1, "script": ["train.py"], "ckpt_dir": str(tmp_path / "l")},
    )
    assert victim in later["exclude"]  # every later submission (and requeue) excludes it
    with run.database.session() as s:
        assert victim in denied_nodes(s)
    (event,) = run.events(Event.kind == EventKind.GPU_FAULT)
    assert (event.node, event.xid, event.gpu_index) == (victim, 79, 3)
    # Acted on as the run's own: the batch step reported its allocation, Slurm confirmed it.
    assert event.foreign is False
    with run.database.session() as s:
        allocation = {n.node: n.role for n in s.scalars(select(AllocationNode))}
    assert victim in allocation and sorted(allocation.values()).count(NodeRole.SPARE) == 1
    kinds = {a.kind: a for a in run.actions() if a.node == victim}
    assert kinds[ActionKind.DRAIN_NODE].status is ActionStatus.DONE
    assert kinds[ActionKind.AGENT_LEAVE].reason.startswith(reason)
    _completes(run)


def test_xid_13_restarts_the_run_and_the_node_stays(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run, inject = _training(cluster, daemon, tmp_path, "xid13")
    node = sorted(set(run.beating_nodes().values()))[0]
    inject.write_text(f"xid=13,gpu=0,node={node}\n")
    # Every agent re-rendezvouses when one restarts its workers; the restarted node may then
    # wait as the spare, so look for a restart anywhere in the run.
    wait_for_value(
        f"the workers to restart after the Xid 13 on {node}",
        lambda: run.events(Event.kind == EventKind.RESTART),
        bool,
        timeout_s=120,
    )
    _completes(run)
    assert not cluster.client.node(node).status.drain_requested  # the node stays
    with run.database.session() as s:
        assert node not in denied_nodes(s, run_id=run.run_id)
    (event,) = run.events(Event.kind == EventKind.GPU_FAULT)
    assert (event.node, event.xid) == (node, 13)
    (action,) = [a for a in run.actions() if a.node == node]
    assert (action.kind, action.status) == (ActionKind.RESTART_WORKERS, ActionStatus.DONE)
