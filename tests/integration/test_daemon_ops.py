"""The daemon as systemd and Prometheus see it: notify messages, the watchdog, /healthz, /metrics.

The daemon runs in-process on a SQLite store with a Slurm stand-in that answers at once (the
real-cluster scrape is in slurm/test_daemon_metrics.py). A fake NOTIFY_SOCKET is a unix datagram
socket bound by the test, as systemd binds its own.
"""

from __future__ import annotations

import itertools
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.daemon_side import daemon_config
from support.waiting import wait_for, wait_for_value

from slurmft.config import Config
from slurmft.controller.daemon import Daemon
from slurmft.controller.notify import Notifier
from slurmft.db import Database
from slurmft.protocol import BATCH_PATH

# serial: the watchdog, /healthz and the stuck-loop verdict are time bounds.
pytestmark = pytest.mark.serial

# Pings every 0.4 s (0.4 x WATCHDOG_USEC): a loaded two-core test machine can hold a thread back
# a few tenths of a second, which a tighter watchdog would count against the daemon.
WATCHDOG_USEC = 1_000_000


class InstantSlurm:
    """Answers the two batched queries of a control pass with an empty cluster."""

    def jobs(self, job_ids: Sequence[str]) -> dict[str, Any]:
        return {}

    def nodes(self, names: Sequence[str] = ()) -> dict[str, Any]:
        return {}

    def node_addresses(self) -> dict[str, str]:  # asked once at start (agents_url)
        return {}


@dataclass
class Message:
    text: str
    at: float  # monotonic


class FakeSystemd:
    """A bound NOTIFY_SOCKET in the abstract namespace, as systemd uses."""

    def __init__(self) -> None:
        self.name = f"@slurmft-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + self.name[1:].encode())
        self.messages: list[Message] = []

    @property
    def environ(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.name, "WATCHDOG_USEC": str(WATCHDOG_USEC)}

    def receive_until(self, wanted: str, timeout_s: float = 10.0) -> Message:
        """Collect messages until one has the line ``wanted``; fail past the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            message = Message(data.decode(), time.monotonic())
            self.messages.append(message)
            if wanted in message.text.splitlines():
                return message
        pytest.fail(f"no {wanted} within {timeout_s} s; got {[m.text for m in self.messages]}")

    def drain(self, for_s: float) -> list[Message]:
        """Every message that arrives in the next ``for_s`` seconds."""
        got: list[Message] = []
        deadline = time.monotonic() + for_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                got.append(Message(self.sock.recv(4096).decode(), time.monotonic()))
            except TimeoutError:
                break
        self.messages += got
        return got

    def close(self) -> None:
        self.sock.close()


def _config(tmp_path: Path) -> Config:
    return daemon_config(tmp_path, "daemon.stuck_after_passes=2")


@pytest.fixture
def systemd() -> Iterator[FakeSystemd]:
    fake = FakeSystemd()
    yield fake
    fake.close()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    made: list[Daemon] = []

    def make(notifier: Notifier | None = None) -> Daemon:
        config = _config(tmp_path)
        database = Database(config.database_url)
        database.upgrade()
        daemon = Daemon(config, database=database, slurm=InstantSlurm(), notifier=notifier)  # type: ignore[arg-type]
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        if not daemon._stopped.is_set():
            daemon.stop()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_ready_after_the_first_slurm_poll_then_watchdog_pings_then_stopping(
    make_daemon: Any, systemd: FakeSystemd
) -> None:
    daemon = make_daemon(Notifier(systemd.environ))
    started = time.monotonic()
    daemon.start()
    ready = systemd.receive_until("READY=1")
    assert daemon.passes >= 1, "READY before the first successful Slurm poll"
    pings = [m for m in systemd.drain(2.0) if m.text == "WATCHDOG=1"]
    assert len(pings) >= 3
    gaps = [b.at - a.at for a, b in itertools.pairwise(pings)]
    # The cadence is under half of WATCHDOG_USEC; systemd itself only minds a gap of all of it
    # (a loaded test machine may delay one ping a little).
    assert statistics.median(gaps) < WATCHDOG_USEC / 1e6 / 2, gaps
    assert max(gaps) < WATCHDOG_USEC / 1e6, gaps
    daemon.stop()
    stopping = systemd.receive_until("STOPPING=1", timeout_s=2)
    print(
        f"READY {ready.at - started:.2f}s after start; {len(pings)} pings, gaps "
        f"{min(gaps):.3f}-{max(gaps):.3f}s; STOPPING {stopping.at - pings[-1].at:.2f}s after "
        f"the last ping"
    )
    texts = [m.text.splitlines()[0] for m in systemd.messages]
    assert texts.index("READY=1") < texts.index("WATCHDOG=1") < texts.index("STOPPING=1")
    assert texts.count("READY=1") == 1


def test_a_stuck_main_loop_fails_healthz_and_stops_the_pings(
    make_daemon: Any, systemd: FakeSystemd
) -> None:
    daemon = make_daemon(Notifier(systemd.environ))
    stuck, release = threading.Event(), threading.Event()
    real_pass = daemon.control_pass

    hung = threading.Event()

    def control_pass() -> int:
        if stuck.is_set():
            hung.set()
            release.wait(30)  # a pass that hangs (a wedged lock, a hung filesystem)
        return real_pass()

    daemon.control_pass = control_pass
    daemon.start()
    systemd.receive_until("READY=1")
    status, body = _get(daemon.metrics_url + "/healthz")
    assert status == 200, body
    assert '"loop": "ok"' in body and '"slurm": "ok"' in body

    stuck.set()
    # From the hanging pass on, no pass can end (max_instances=1): a pass already running when
    # the flag was set would end, and bring the pings back, while the test waits for silence.
    assert hung.wait(5), "no control pass started after the flag"
    healthz = daemon.metrics_url + "/healthz"
    _, failed_after = wait_for_value(
        "/healthz to fail", lambda: _get(healthz)[0], (200).__ne__, 5, interval_s=0.1
    )
    status, body = _get(daemon.metrics_url + "/healthz")
    assert status == 503 and '"loop": "stuck"' in body, body
    systemd.drain(0.3)  # a ping sent just before the verdict may still be in flight
    assert [m.text for m in systemd.drain(1.0) if m.text == "WATCHDOG=1"] == []
    _, metrics = _get(daemon.metrics_url + "/metrics")
    assert 'slurmft_scheduler_jobs_skipped_total{job="control",reason="busy"}' in metrics

    release.set()  # the pass finishes: the loop and the pings come back
    systemd.receive_until("WATCHDOG=1", timeout_s=3)
    assert _get(daemon.metrics_url + "/healthz")[0] == 200
    print(f"/healthz failed {failed_after:.2f}s after the loop got stuck (limit 1.0 s)")


def test_metrics_endpoint_serves_build_info_store_counts_and_slurm_latency(
    make_daemon: Any, seed_run: Any
) -> None:
    daemon = make_daemon()
    seed_run(daemon.database, "rm1", job_id=None)
    daemon.start()
    # The counter, not daemon.passes: the pass is counted before its tick adds it to /metrics.
    completed = {"outcome": "completed"}
    wait_for(
        lambda: daemon.metrics.registry.get_sample_value("slurmft_control_passes_total", completed),
        5,
        "a completed control pass on /metrics",
        interval_s=0.05,
    )
    refused = urllib.request.Request(daemon.ingest_url + BATCH_PATH, data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(refused, timeout=5)  # no run token
    status, text = _get(daemon.metrics_url + "/metrics")
    assert status == 200
    assert 'slurmft_ingest_requests_total{code="401"} 1.0' in text
    assert 'slurmft_build_info{python="' in text
    assert 'slurmft_runs{state="running"} 1.0' in text
    assert 'slurmft_recoveries_total{kind="agent_leave"} 0.0' in text
    assert "slurmft_store_up 1.0" in text
    assert 'slurmft_control_passes_total{outcome="completed"}' in text
    assert "slurmft_scheduler_job_lag_seconds_bucket" in text
    for line in text.splitlines():
        assert "rm1" not in line, f"a run id as a label: {line}"


def test_healthz_fails_when_the_store_is_unreachable() -> None:
    from slurmft.controller.health import LoopLiveness, check_health

    unreachable = Database("postgresql://slurmft@127.0.0.1:1/slurmft")
    health = check_health(LoopLiveness(60.0), unreachable)
    assert not health.ok
    assert health.checks["loop"] == "ok" and health.checks["store"] != "ok"
    unreachable.dispose()


def test_the_daemon_and_the_cli_load_without_matplotlib() -> None:
    import subprocess
    import sys

    code = (
        "import sys, slurmft.controller.daemon, slurmft.cli.app\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_store_counts_are_read_at_scrape_time(database: Database, seed_run: Any) -> None:
    """On SQLite and PostgreSQL: rows written by anyone show at the next scrape; observe-only
    (skipped) recoveries are not counted, a refused drain is counted as skipped."""
    from slurmft.controller.metrics import DaemonMetrics
    from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind

    metrics = DaemonMetrics(database)

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert sample("slurmft_store_up") == 1
    assert sample("slurmft_recoveries_total", kind="requeue") == 0
    seed_run(database, "rc", job_id="5")
    with database.session() as s:
        for status in (ActionStatus.DONE, ActionStatus.SKIPPED):
            s.add(Action(run_id="rc", kind=ActionKind.REQUEUE, reason="r", status=status))
        s.add(
            Action(
                run_id="rc",
                kind=ActionKind.DRAIN_NODE,
                node="n1",
                reason="xid 79",
                status=ActionStatus.SKIPPED,
                error="drain requested, not permitted: ...",
            )
        )
        s.add(Event(run_id="rc", kind=EventKind.STRAGGLER, node="n2", rank=3))
    assert sample("slurmft_runs", state="running") == 1
    assert sample("slurmft_recoveries_total", kind="requeue") == 1
    assert sample("slurmft_drains_total", status="skipped") == 1
    assert sample("slurmft_straggler_flags_total") == 1
    assert sample("slurmft_failures_total", kind="straggler") == 1
