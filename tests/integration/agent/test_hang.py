"""A hung worker: the agent saves every local worker's Python stacks, then kills the hung ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_cluster import AgentCluster
from support.waiting import wait_for

from slurmft.agent.procs import is_alive

pytestmark = [pytest.mark.torch, pytest.mark.serial]  # a 2 s step deadline


def test_hung_worker_stacks_are_saved_before_it_is_killed(tmp_path: Path) -> None:
    # Rank 1 sleeps 100 s inside step 4's forward pass; rank 0 waits for it in the all-reduce.
    # Both stop making progress; the step deadline (2 s) makes their heartbeats overdue.
    args = ["--steps", "50", "--work-ms", "50", "--slow-rank", "1", "--slow-factor", "2000",
            "--slow-from-step", "3", "--step-deadline-s", "2", "--heartbeat-interval-s", "0.3"]
    run = AgentCluster(tmp_path, 1, args, nproc_per_node=2)
    try:
        run.start(1)
        (agent,) = run.agents
        run.wait_for_step(3, 120)
        hung_pids = agent.worker_pids()
        assert len(hung_pids) == 2
        wait_for(lambda: "stacks saved, killing" in agent.log(), 60, "the hang to be handled")
        stacks = {p.name: p.read_text() for p in (agent.work_dir / "stacks").glob("stacks-*")}
        (rank1,) = [text for name, text in stacks.items() if name.startswith("stacks-rank1-")]
        assert "_forward_backward" in rank1  # where it hangs: the simulated compute
        (rank0,) = [text for name, text in stacks.items() if name.startswith("stacks-rank0-")]
        assert "all_reduce" in rank0  # and where its peer waits
        wait_for(lambda: not any(is_alive(pid) for pid in hung_pids), 30, "the workers to die")
        # torchrun restarts the workers in place.
        wait_for(lambda: set(agent.worker_pids()) - set(hung_pids), 60, "restarted workers")
    finally:
        run.stop()
