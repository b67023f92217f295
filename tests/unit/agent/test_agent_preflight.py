"""The agent's preflight: a GPU fault keeps the node out; a clock skew is reported, not fatal."""

from __future__ import annotations

import time
from pathlib import Path

from slurmft.agent.agent import AgentSettings, NodeAgent
from slurmft.agent.command import TorchrunSpec
from slurmft.agent.exits import AgentExit
from slurmft.agent.probe import GpuFault, GpuReport, NoGpuProbe
from slurmft.protocol import Command


class FaultyGpu:
    def probe(self) -> GpuReport:
        return GpuReport(True, 8, (GpuFault("Xid 79: GPU has fallen off the bus", 3, 79),))


class ControllerClock:
    def __init__(self, offset_s: float):
        self.offset_s = offset_s

    def server_time(self) -> float:
        return time.time() + self.offset_s


def agent(tmp_path: Path, probe: object = None) -> NodeAgent:
    spec = TorchrunSpec(nodes=1, nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", rdzv_id="r",
                        script=("/nonexistent/train.py",))
    settings = AgentSettings(spec=spec, node="n1", run_id="r", work_dir=tmp_path / "w",
                             controller_url="http://127.0.0.1:9")  # never reached here
    return NodeAgent(settings, probe or NoGpuProbe())  # type: ignore[arg-type]


def test_gpu_fault_stops_the_agent_before_torchrun(tmp_path: Path) -> None:
    node = agent(tmp_path, FaultyGpu())
    node.transport = None  # no clock check: the probe decides alone
    assert node.preflight() is False
    assert node.reporter is not None
    kinds = [(e.kind, e.details.get("xid")) for e in node.reporter.buffer.events]
    assert kinds == [("gpu_fault", 79), ("preflight_failed", None)]


def test_clock_skew_over_a_second_is_reported_and_the_agent_carries_on(tmp_path: Path) -> None:
    node = agent(tmp_path)
    node.transport = ControllerClock(3.0)  # type: ignore[assignment]
    assert node.preflight() is True
    assert node.reporter is not None
    (event,) = node.reporter.buffer.events
    assert event.kind == "preflight_failed" and event.details["check"] == "clock_skew"
    assert 2.5 < event.details["offset_s"] < 3.5 and event.details["fatal"] is False


def test_small_skew_is_fine(tmp_path: Path) -> None:
    node = agent(tmp_path)
    node.transport = ControllerClock(0.2)  # type: ignore[assignment]
    assert node.preflight() is True
    assert node.reporter is not None and not node.reporter.buffer.events


def test_run_with_a_faulty_gpu_exits_unfit(tmp_path: Path) -> None:
    node = agent(tmp_path, FaultyGpu())
    node.transport = None
    assert node.reporter is not None
    node.reporter.stop = lambda flush_timeout_s=0.0: None  # type: ignore[method-assign]
    node.reporter.start = lambda: node.reporter  # type: ignore[method-assign,return-value]
    assert node.run() == AgentExit.PREFLIGHT_FAILED


def test_commands_leave_and_restart(tmp_path: Path) -> None:
    node = agent(tmp_path)
    node.on_command(Command("restart_workers", "hang decided by the controller"))
    node.on_command(Command("restart_workers", "repeated in the next reply"))
    assert node.state.restart_requested == "hang decided by the controller"
    node.on_command(Command("leave", "node cordoned"))
    assert node.state.stop_reason == "leave: node cordoned"
