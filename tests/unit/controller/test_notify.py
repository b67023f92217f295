"""The sd_notify protocol: one datagram per message, path or abstract socket, no-op when unset."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from slurmft.controller.metrics import DaemonMetrics, TimedRunner
from slurmft.controller.notify import Notifier, send, watchdog_interval_s
from slurmft.slurm.api import SlurmTimeout
from slurmft.slurm.runner import CommandResult


def _bound(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


def test_one_datagram_to_a_socket_path(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    with _bound(str(path)) as sock:
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        notifier.ready("up")
        notifier.ready("again")  # READY is said once
        notifier.stopping()
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
        assert sock.recv(4096) == b"STOPPING=1"


def test_ready_sent_is_true_only_once_ready_is_on_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watchdog job pings from another thread once it reads ready_sent: read while READY=1
    is still being sent, it could put WATCHDOG=1 ahead of READY=1 (seen once in a daemon test
    on a loaded machine)."""
    notifier = Notifier({"NOTIFY_SOCKET": "@unused"})
    seen_while_sending: list[bool] = []

    def send_and_look(message: str, environ: object = None) -> bool:
        seen_while_sending.append(notifier.ready_sent)
        return True

    monkeypatch.setattr("slurmft.controller.notify.send", send_and_look)
    notifier.ready()
    assert seen_while_sending == [False]
    assert notifier.ready_sent


def test_abstract_socket_names_start_with_at() -> None:
    name = f"slurmft-unit-{uuid.uuid4().hex}"
    with _bound(b"\0" + name.encode()) as sock:
        assert send("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_no_socket_is_a_no_op_and_a_dead_one_is_not_an_error(tmp_path: Path) -> None:
    assert send("READY=1", {}) is False
    assert send("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")}) is False


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "60000000"}, 24.0),  # under half of 60 s
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}, 24.0),
    ],
)
def test_watchdog_interval(environ: dict[str, str], interval: float | None) -> None:
    assert watchdog_interval_s(environ) == interval


class _Runner:
    def __init__(self, outcome: CommandResult | Exception) -> None:
        self.outcome = outcome

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _value(metrics: DaemonMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_timed_runner_counts_latency_and_failures() -> None:
    metrics = DaemonMetrics()
    ok = CommandResult(("squeue",), 0, "", "")
    TimedRunner(_Runner(ok), metrics).run(["/usr/bin/squeue", "-h"], 5)
    failed = CommandResult(("scontrol",), 1, "", "Invalid job id")
    TimedRunner(_Runner(failed), metrics).run(["scontrol", "show"], 5)
    with pytest.raises(SlurmTimeout):
        TimedRunner(_Runner(SlurmTimeout("slow")), metrics).run(["sinfo"], 5)
    assert _value(metrics, "slurmft_slurm_command_duration_seconds_count", command="squeue") == 1
    # Its error series exists from the start (the dashboard reads it), and stays at zero.
    assert (
        _value(metrics, "slurmft_slurm_command_errors_total", command="squeue", error="exit_status")
        == 0
    )
    assert (
        _value(
            metrics, "slurmft_slurm_command_errors_total", command="scontrol", error="exit_status"
        )
        == 1
    )
    assert (
        _value(metrics, "slurmft_slurm_command_errors_total", command="sinfo", error="timeout") == 1
    )
    assert _value(metrics, "slurmft_slurm_command_duration_seconds_count", command="sinfo") == 1
