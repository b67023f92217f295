"""The agent's side of a hang the daemon found: what it forwards and what it kills."""

from __future__ import annotations

import os
from pathlib import Path

from slurmft.agent.agent import AgentSettings, NodeAgent
from slurmft.agent.command import TorchrunSpec
from slurmft.agent.procs import is_alive
from slurmft.protocol import Command, RankHeartbeat

DEAD_PID = 2**22 + 7  # above pid_max's default: no such process


class Channel:
    def __init__(self, *records: RankHeartbeat) -> None:
        self.records = list(records)

    def drain(self) -> list[RankHeartbeat]:
        records, self.records = self.records, []
        return records


def _agent(tmp_path: Path) -> NodeAgent:
    spec = TorchrunSpec(
        nodes=1, nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", rdzv_id="r", script=("x.py",)
    )
    settings = AgentSettings(
        spec=spec, node="n1", run_id="r", work_dir=tmp_path, controller_url="http://127.0.0.1:9"
    )
    return NodeAgent(settings)


def _beat(pid: int) -> RankHeartbeat:
    return RankHeartbeat(1, 0, "step", 12, 0.2, 300.0, False, 1.0, pid=pid)


def test_a_killed_workers_last_heartbeat_is_not_forwarded(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    agent.state.killed_pids.add(4242)  # continued for its stack dump, beat once, then killed
    agent._take_reports(Channel(_beat(4242), _beat(4343)))  # type: ignore[arg-type]
    assert agent.reporter is not None
    assert [hb.pid for hb in agent.reporter.buffer.heartbeats] == [4343]
    assert [w.pid for w in agent.state.workers.values()] == [4343]


def test_a_restart_command_with_no_worker_alive_is_dropped_not_kept_for_the_next_ones(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path)
    agent._take_reports(Channel(_beat(DEAD_PID)))  # type: ignore[arg-type]
    assert not is_alive(DEAD_PID)
    agent.on_command(Command("restart_workers", "slurmft: hang rank 1 silent for 6s"))
    agent._kill_hung_workers()  # torchrun is restarting them already
    assert agent.state.restart_requested == ""
    # The fresh worker that comes up next is not killed for the old command.
    agent._take_reports(Channel(_beat(os.getpid())))  # type: ignore[arg-type]
    agent._kill_hung_workers()
    assert is_alive(os.getpid()) and not agent.state.killed_pids
