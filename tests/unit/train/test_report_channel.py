from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmft.train import report
from slurmft.train.report import SCHEMA_VERSION, SOCKET_ENV, ReportChannel, decode

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
    assert channel.stats.dropped > 0
    assert channel.stats.sent + channel.stats.dropped == 5000
    assert "EAGAIN" in channel.stats.drop_reasons
    assert elapsed < 5.0  # a blocking send would hang here forever


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
