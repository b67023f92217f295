"""The controller's `leave` command: the agent stops its workers and exits, a spare takes its
place, and everything the ranks reported on the way reached the controller."""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_cluster import AgentCluster
from support.fake_controller import FakeController
from support.waiting import wait_for

from slurmft.agent.exits import AgentExit
from slurmft.protocol import Command

pytestmark = pytest.mark.torch

ARGS = ["--steps", "30", "--ckpt-every", "5", "--work-ms", "150", "--heartbeat-interval-s", "1",
        "--pg-timeout-s", "30"]


def test_leave_command_hands_the_node_to_the_spare(tmp_path: Path) -> None:
    controller = FakeController().start()
    run = AgentCluster(tmp_path, 3, ARGS, settings=[f"agent.controller_url={controller.url}",
                                                     "agent.report_interval_s=0.2"])
    try:
        run.start(4)
        run.wait_for_step(8, 150)
        active = run.active_agents()
        (spare,) = [a for a in run.agents if a not in active]
        leaving = active[1]
        controller.order(f"n{leaving.index}", Command("leave", "node cordoned for this run"))
        assert leaving.process.wait(timeout=60) == AgentExit.LEFT
        wait_for(spare.worker_pids, 150, f"the spare to train\n{run.logs_tail()}")
        run.wait_done(150)
        assert {r["world_size"] for r in run.records()} == {3}
        batches = controller.received()
        events = [(b.node, e.kind) for b in batches for e in b.events]
        assert (f"n{leaving.index}", "agent_stopped") in events  # it said why it left
        assert any(kind == "restart" for _, kind in events)  # survivors restarted their workers
        ranks = {hb.rank for b in batches for hb in b.heartbeats}
        assert ranks == {0, 1, 2}
        steps = {(st.rank, st.step) for b in batches for st in b.step_times}
        assert {step for _, step in steps} >= set(range(2, 30))
        seqs: dict[str, list[int]] = {}
        for b in batches:
            seqs.setdefault(b.agent_id, []).append(b.seq)
        assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())
    finally:
        run.stop()
        controller.stop()
