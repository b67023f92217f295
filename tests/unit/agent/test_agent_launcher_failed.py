"""An agent whose torchrun fails says so to the daemon (`launcher_failed`): a dead batch host
takes the rendezvous store with it, and the other nodes' torchrun exit before any of their
ranks may report the dead peer (slurmft.controller.goodput_pass takes it as the outage's first
sign). Where the launcher saw the store fail first, the report is dated from that; the
launcher tells it (slurmft.agent.peer_detector)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from support.waiting import wait_for

from slurmft.agent.agent import AgentSettings, NodeAgent
from slurmft.agent.channel import (
    STORE_BACK_MESSAGE,
    STORE_FAILED_MESSAGE,
    RankChannelServer,
    StoreHealth,
)
from slurmft.agent.command import TorchrunSpec
from slurmft.agent.exits import AgentExit
from slurmft.agent.peer_detector import PeerDetector
from slurmft.agent.peer_watch import WatchSettings
from slurmft.agent.probe import NoGpuProbe
from slurmft.core.kinds import EventKind
from slurmft.train.report import ReportChannel


def _agent(tmp_path: Path) -> NodeAgent:
    spec = TorchrunSpec(nodes=2, nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", rdzv_id="r",
                        script=("train.py",))  # fmt: skip
    settings = AgentSettings(spec=spec, node="n2", run_id="r", work_dir=tmp_path / "w",
                             controller_url="http://127.0.0.1:9")  # fmt: skip
    return NodeAgent(settings, NoGpuProbe())  # type: ignore[arg-type]


def test_a_failed_torchrun_is_reported_with_its_exit_code(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    assert agent._exit_code(1) is AgentExit.FAILED
    assert agent.reporter is not None
    (event,) = agent.reporter.buffer.events
    assert (event.kind, event.message) == (EventKind.LAUNCHER_FAILED, "torchrun exited with 1")
    assert event.details["exit_code"] == 1 and event.details["node"] == "n2"
    assert event.fault_class is None  # evidence, not a failure of this node


def test_no_report_when_the_agent_was_being_stopped_too(tmp_path: Path) -> None:
    """Slurm's SIGTERM at a requeue reaches torchrun and the agent alike: no failure of its own."""
    agent = _agent(tmp_path)
    agent.request_stop("SIGTERM")
    assert agent._exit_code(1) is AgentExit.FAILED
    assert agent.reporter is not None
    assert list(agent.reporter.buffer.events) == []


def test_a_clean_exit_reports_nothing(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    assert agent._exit_code(0) is AgentExit.FINISHED
    assert agent.reporter is not None
    assert list(agent.reporter.buffer.events) == []


def test_a_failure_after_the_store_failed_is_dated_from_the_stores_failure(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    failed_at = time.time() - 1.2
    agent.state.store_failed = StoreHealth(True, failed_at, "Connection reset by peer")
    before = time.time()
    assert agent._exit_code(1) is AgentExit.FAILED
    assert agent.reporter is not None
    (event,) = agent.reporter.buffer.events
    assert event.kind is EventKind.LAUNCHER_FAILED and event.occurred_at == failed_at
    assert event.message == (
        "torchrun exited with 1 after the rendezvous store failed (Connection reset by peer)"
    )
    assert event.details["store_error"] == "Connection reset by peer"
    assert event.details["exited_at"] >= before


def test_a_store_failure_long_before_the_exit_dates_nothing(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    agent.state.store_failed = StoreHealth(True, time.time() - 120, "Connection reset by peer")
    before = time.time()
    agent._exit_code(1)
    assert agent.reporter is not None
    (event,) = agent.reporter.buffer.events
    assert event.occurred_at >= before and event.message == "torchrun exited with 1"


def test_a_store_that_answers_again_dates_nothing(tmp_path: Path) -> None:
    """A store its supervisor restarted came back: a later failure of torchrun is its own."""
    agent = _agent(tmp_path)
    server = RankChannelServer(str(tmp_path / "ranks.sock"))
    launcher = ReportChannel(str(tmp_path / "ranks.sock"), {"rank": 0, "rdzv_round": None})
    try:
        launcher.send(STORE_FAILED_MESSAGE, error="Connection reset by peer")
        agent._take_reports(server)
        assert agent.state.store_failed is not None and agent.state.store_failed.failed
        launcher.send(STORE_BACK_MESSAGE)
        agent._take_reports(server)
        assert agent.state.store_failed is None
    finally:
        server.close()
    assert agent.reporter is not None
    assert list(agent.reporter.buffer.events) == []  # the store's word alone is no event


class FlakyStore:
    """A rendezvous store that fails while ``down`` is set (a dead batch host's, or one its
    supervisor restarts)."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.values: dict[str, str] = {}

    def _check(self) -> None:
        if self.down.is_set():
            raise ConnectionResetError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        self._check()
        self.values[key] = value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._check()
        current = self.values.get(key)
        if current is None and expected == "":
            self.values[key] = desired
            return desired.encode()
        return (current or "").encode()


def test_the_detector_tells_its_agent_when_the_store_fails_and_when_it_answers_again() -> None:
    store = FlakyStore()
    told: list[tuple[str, dict[str, Any]]] = []
    detector = PeerDetector(
        store, me="n2", round_members=lambda: None, run_id="r",
        settings=WatchSettings(heartbeat_s=0.01, dead_after_s=1.0),
        tell=lambda kind, **fields: told.append((kind, fields)), say=lambda _: None,
        fence=lambda: None,
    )  # fmt: skip
    detector.start()
    try:
        wait_for(lambda: store.values, timeout_s=5, what="the detector's first heartbeat")
        store.down.set()
        wait_for(lambda: told, timeout_s=5, what="the store's failure told")
        store.down.clear()
        wait_for(lambda: len(told) == 2, timeout_s=5, what="the store's return told")
    finally:
        detector.stopped.set()
        detector.join(timeout=5)
    assert told == [
        (STORE_FAILED_MESSAGE, {"error": "Connection reset by peer"}),
        (STORE_BACK_MESSAGE, {}),
    ]
