"""SIGUSR1 to an agent (what `scancel --signal=USR1` sends to the agent step) becomes a save of
every rank at the same step boundary, through the training library's save-request file."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from agent_cluster import AgentCluster
from support.waiting import wait_for

pytestmark = pytest.mark.torch


def test_usr1_to_the_agent_makes_the_ranks_save(tmp_path: Path) -> None:
    args = ["--steps", "400", "--ckpt-every", "1000", "--work-ms", "50"]
    run = AgentCluster(tmp_path, 1, args, nproc_per_node=2)
    try:
        run.start(1)
        run.wait_for_step(5, 120)
        os.kill(run.agents[0].process.pid, signal.SIGUSR1)
        (saved,) = wait_for(lambda: run.events("saved"), 60, "the requested save")
        assert saved["reason"] == "requested"
        assert (tmp_path / "ckpt" / f"step-{saved['step']:09d}").is_dir()
        assert run.agents[0].process.poll() is None  # the agent carries on
    finally:
        run.stop()
