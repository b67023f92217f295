"""slurmft's dead-peer detector on localhost agents (slurmft.agent.peer_detector): a frozen node
is declared dead and evicted, the spare takes its rank, and when the node thaws it is fenced: its
workers train no step and its agent leaves. A node stopped for one second is not declared."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from agent_cluster import AgentCluster
from support.fake_controller import FakeController
from support.processes import environ_of
from support.waiting import wait_for

from slurmft.agent.exits import AgentExit
from slurmft.agent.procs import descendants, is_alive, signal_pids

# serial: a 1.5 s silence is a death; a 1 s stop must not be, whatever the other tests' load.
pytestmark = [pytest.mark.torch, pytest.mark.serial]

ARGS = ["--steps", "400", "--ckpt-every", "5", "--work-ms", "100", "--heartbeat-interval-s", "1",
        "--pg-timeout-s", "30"]  # fmt: skip


# One launcher poll (0.1 s, docs/agent.md's "Fencing"), with room for a slow scheduler.
FENCE_BOUND_S = 1.0


def node_tree(agent_pid: int) -> list[int]:
    return [agent_pid, *descendants(agent_pid)]


def rank_zero_node(cluster: AgentCluster) -> int:
    """The index of the agent whose worker is rank 0 (it writes losses.jsonl)."""
    for agent in cluster.active_agents():
        if any(b"RANK=0" in environ_of(pid) for pid in agent.worker_pids()):
            return agent.index
    raise AssertionError("no worker of rank 0")


def test_a_frozen_node_is_evicted_and_fenced_when_it_thaws(tmp_path: Path) -> None:
    controller = FakeController().start()
    cluster = AgentCluster(tmp_path, 3, ARGS, settings=[f"agent.controller_url={controller.url}",
                                                        "agent.report_interval_s=0.2"])  # fmt: skip
    try:
        cluster.start(4)
        cluster.wait_for_step(8, 150)
        frozen = cluster.agents[rank_zero_node(cluster)]
        old_round = cluster.records()[-1]["attempt"]
        pids = node_tree(frozen.process.pid)
        signal_pids(pids, signal.SIGSTOP)  # slurmd aside, the node as a whole: nothing runs
        # The spare took the frozen node's rank: rank 0 now writes from another node.
        wait_for(
            lambda: any(r["attempt"] != old_round for r in cluster.records()),
            60,
            f"a step of a new round\n{cluster.logs_tail()}",
        )
        new_round = cluster.records()[-1]["attempt"]
        before_thaw = cluster.records()
        last_old_step = max(r["step"] for r in before_thaw if r["attempt"] == old_round)
        thawed_at = time.time()
        signal_pids(pids, signal.SIGCONT)
        assert frozen.process.wait(timeout=30) == AgentExit.FENCED
        time.sleep(2)  # the others train on; a thawed rank 0 would have written its own lines
        after = cluster.records()[len(before_thaw) :]
        assert after, "training went on"
        assert {r["attempt"] for r in after} - {old_round} == {new_round}
        # The fence bounds a thawed worker by one poll (0.1 s), not by nothing: frozen after its
        # step's collectives and before its log line, rank 0 may still write that line. It can
        # train no step: the next one needs peers it no longer has.
        late = [r for r in after if r["attempt"] == old_round]
        assert [r["step"] for r in late] in ([], [last_old_step + 1]), late
        assert all(r["time"] - thawed_at < FENCE_BOUND_S for r in late), (thawed_at, late)
        assert not [pid for pid in pids if is_alive(pid)], "every process of the node is gone"
        assert "this node was declared dead by its peers" in frozen.log()
        declared = [a for a in cluster.agents if "declared dead and evicted" in a.log()]
        assert declared and frozen not in declared
        events = [(b.node, e.kind, e.details) for b in controller.received() for e in b.events]
        assert (f"n{frozen.index}", "fenced") in {(node, kind) for node, kind, _ in events}
        peer_dead = [details for _, kind, details in events if kind == "peer_dead"]
        assert peer_dead and all(d["silent_s"] >= 1.5 for d in peer_dead)
    finally:
        cluster.stop()
        controller.stop()


def test_a_node_stopped_for_one_second_is_not_declared_dead(tmp_path: Path) -> None:
    cluster = AgentCluster(tmp_path, 3, ARGS)
    try:
        cluster.start(3)
        cluster.wait_for_step(8, 150)
        agent = cluster.active_agents()[1]
        old_round = cluster.records()[-1]["attempt"]
        pids = node_tree(agent.process.pid)
        signal_pids(pids, signal.SIGSTOP)
        time.sleep(1.0)
        signal_pids(pids, signal.SIGCONT)
        steps_after_thaw = len(cluster.records())
        wait_for(lambda: len(cluster.records()) >= steps_after_thaw + 20, 60, "training on")
        assert {r["attempt"] for r in cluster.records()} == {old_round}  # no restart
        assert not any("declared dead" in a.log() for a in cluster.agents)
        assert agent.process.poll() is None
    finally:
        cluster.stop()
