from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmft.train import report
from slurmft.train.report import BACKLOG, SCHEMA_VERSION, SOCKET_ENV, ReportChannel, decode

IDENTITY = {"rank": 2, "local_rank": 0, "world_size": 3, "run_id": "r", "restart_count": 0}


@pytest.fixture
def agent_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "agent.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(2)
    yield receiver, path
    receiver.close()


def test_a_present_agent_receives_versioned_json(agent_socket: tuple[socket.socket, str]) -> None:
    receiver, path = agent_socket
    channel = ReportChannel(path, IDENTITY)
    assert channel.send("heartbeat", phase="step", step=7)
    message = decode(receiver.recv(65536))
    assert message["v"] == SCHEMA_VERSION
    assert (message["kind"], message["phase"], message["step"], message["rank"]) == (
        "heartbeat",
        "step",
        7,
        2,
    )
    assert channel.stats.sent == 1


def test_no_agent_configured_drops_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    channel = ReportChannel(identity=IDENTITY)
    assert not channel.enabled
    assert not channel.send("heartbeat", phase="step")
    assert channel.stats.dropped == 1


def test_a_missing_agent_drops_without_raising_and_is_retried_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agent.sock"
    channel = ReportChannel(str(path), IDENTITY)
    assert not channel.send("heartbeat", phase="step")
    assert not channel.send("heartbeat", phase="step")  # within the retry pause: no syscall
    assert channel.stats.drop_reasons == {"ENOENT": 1, "agent_absent": 1}
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    monkeypatch.setattr(report, "ABSENT_RETRY_S", 0.0)
    channel._retry_at = time.monotonic()  # the pause is over
    try:
        assert channel.send("heartbeat", phase="step")
    finally:
        receiver.close()


@pytest.mark.serial  # bounds a wait in seconds
def test_a_full_agent_never_blocks_the_sender(agent_socket: tuple[socket.socket, str]) -> None:
    _, path = agent_socket  # bound but never read: its queue fills up
    channel = ReportChannel(path, IDENTITY)
    began = time.perf_counter()
    for _ in range(5000):
        channel.send("step", step=1, compute_s=0.2, wait_s=0.01, pad="x" * 200)
    elapsed = time.perf_counter() - began
    # What the kernel took, then a full backlog, then drops of the newest.
    assert channel.stats.drop_reasons == {"backlog_full": 5000 - channel.stats.sent - BACKLOG}
    assert channel.flush() == BACKLOG
    assert elapsed < 5.0  # a blocking send would hang here forever


def test_what_the_agents_full_queue_refuses_goes_out_later_in_order(
    agent_socket: tuple[socket.socket, str],
) -> None:
    """Linux queues about ten datagrams on the agent's socket whatever its buffer size: the
    ranks of a node ending a step together overflow it before the agent's next read."""
    receiver, path = agent_socket
    channel = ReportChannel(path, IDENTITY)
    for step in range(1, 41):
        assert channel.send("step", step=step, compute_s=0.1, wait_s=0.0)
    queued = channel.stats.sent
    assert 0 < queued < 40 and channel.flush() == 40 - queued  # the rest wait, none dropped
    assert channel.send("heartbeat", phase="step", step=40)  # behind them, not before
    receiver.setblocking(False)
    received: list[tuple[str, int]] = []
    for _ in range(100):  # the agent reads, the rank sends again, and so on
        while True:
            try:
                message = decode(receiver.recv(65536))
            except BlockingIOError:
                break
            received.append((message["kind"], message["step"]))
        if channel.flush() == 0 and len(received) == 41:
            break
    assert received == [*(("step", s) for s in range(1, 41)), ("heartbeat", 40)]
    assert channel.stats.dropped == 0 and channel.stats.sent == 41


def test_a_ranks_last_reports_wait_for_the_agent_to_read(
    agent_socket: tuple[socket.socket, str],
) -> None:
    receiver, path = agent_socket
    channel = ReportChannel(path, IDENTITY)
    for step in range(1, 31):
        channel.send("step", step=step, compute_s=0.1, wait_s=0.0)
    assert channel.flush() > 0
    got: list[int] = []
    reader = threading.Thread(
        target=lambda: got.extend(decode(receiver.recv(65536))["step"] for _ in range(30))
    )
    reader.start()
    assert channel.flush(timeout_s=10) == 0
    reader.join(timeout=10)
    assert got == list(range(1, 31))


def test_a_backlog_whose_agent_went_away_is_dropped_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    channel = ReportChannel(str(path), IDENTITY)
    for step in range(1, 31):
        channel.send("step", step=step, compute_s=0.1, wait_s=0.0)
    waiting = channel.flush()
    receiver.close()
    path.unlink()  # the agent ended
    assert channel.flush() == 0  # one refusal, then the rest without a system call each
    reasons = channel.stats.drop_reasons
    assert reasons.pop("agent_absent") == waiting - 1
    assert reasons in ({"ECONNREFUSED": 1}, {"ENOENT": 1})


def test_a_socket_path_from_the_environment(
    agent_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, path = agent_socket
    monkeypatch.setenv(SOCKET_ENV, path)
    monkeypatch.setenv("RANK", "5")
    ReportChannel().send("event", event="x")
    message = decode(receiver.recv(65536))
    assert (message["rank"], message["pid"]) == (5, os.getpid())


def test_a_message_of_another_schema_version_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        decode(b'{"v": 99, "kind": "heartbeat"}')
