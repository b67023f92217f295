"""`slurmft daemon` as systemd runs it, on the real local Slurm cluster: READY after its first
real Slurm poll, watchdog pings, a killed node recovered and counted on /metrics, STOPPING and a
clean exit on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from local_cluster import Cluster
from support.promtool import rule_tests, run_promtool
from support.waiting import wait_for_value

from slurmft.db import Database

pytestmark = [pytest.mark.slurm, pytest.mark.serial]  # the watchdog's 1 s pings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    name = f"@slurmft-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name[1:].encode())
    yield name, sock
    sock.close()


@pytest.fixture
def daemon_env(tmp_path: Path, notify_socket: tuple[str, socket.socket]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    return base | {
        "SLURMFT_PATHS_STATE_DIR": str(tmp_path / "state"),
        "SLURMFT_PATHS_RUNTIME_DIR": str(tmp_path / "run"),
        "SLURMFT_DAEMON_POLL_INTERVAL_S": "1",
        "SLURMFT_POLICY_CONFIRM_S": "2",
        "SLURMFT_DAEMON_INGEST_LISTEN": "127.0.0.1:0",
        "SLURMFT_DAEMON_METRICS_LISTEN": f"127.0.0.1:{_free_port()}",
        "SLURMFT_SLURM_CONF": os.environ["SLURM_CONF"],
        "NOTIFY_SOCKET": notify_socket[0],
        "WATCHDOG_USEC": "2000000",
    }


def _receive(sock: socket.socket, wanted: str, timeout_s: float) -> list[str]:
    """Datagrams until one holds the line ``wanted``."""
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if wanted in got[-1].splitlines():
            return got
    pytest.fail(f"no {wanted} within {timeout_s} s; got {got}")


def _metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name + (f"{{{want}}}" if want else "")) + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_daemon_under_a_fake_systemd_counts_the_recovery_of_a_killed_node(
    cluster: Cluster,
    daemon_env: dict[str, str],
    notify_socket: tuple[str, socket.socket],
    seed_run: Callable[..., None],
    tmp_path: Path,
) -> None:
    subprocess.run(
        [sys.executable, "-m", "slurmft", "db", "upgrade"],
        env=daemon_env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    database = Database(f"sqlite:///{daemon_env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    job_id = cluster.submit(
        ["sleep", "300"], nodes=3, spare_nodes=1, run_id="rm", ntasks_per_node=1
    )
    job, _ = cluster.wait_running(job_id)
    seed_run(database, "rm", job_id=job_id)
    metrics_url = f"http://{daemon_env['SLURMFT_DAEMON_METRICS_LISTEN']}/metrics"

    log = tmp_path / "daemon.log"
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurmft", "daemon"], env=daemon_env, stdout=out, stderr=out
        )
    try:
        _, sock = notify_socket
        _receive(sock, "READY=1", timeout_s=30)
        ready_s = time.monotonic() - started
        _receive(sock, "WATCHDOG=1", timeout_s=5)

        def scrape() -> str:
            with urllib.request.urlopen(metrics_url, timeout=5) as reply:
                return reply.read().decode()

        before = scrape()
        assert _metric(before, "slurmft_recoveries_total", kind="agent_leave") == 0
        assert _metric(before, "slurmft_runs", state="running") == 1

        victim = next(n for n in job.nodes if n != job.batch_host)
        killed_at = time.monotonic()
        cluster.kill_node(victim)
        # Recoveries and failures are read from the store at each scrape; the detection
        # latency is observed in the daemon as the pass's event row commits: wait for both.
        after, took = wait_for_value(
            "the recovery and its detection latency on /metrics",
            scrape,
            lambda text: _metric(text, "slurmft_recoveries_total", kind="agent_leave") == 1
            and _metric(text, "slurmft_detection_latency_seconds_count", kind="node_lost") == 1,
            timeout_s=40,
        )
        assert _metric(after, "slurmft_failures_total", kind="node_lost") == 1
        # The shipped alerts and dashboard, against this real scrape (tests/support/promtool).
        run_promtool("check", "metrics", stdin=after)
        assert "SUCCESS" in rule_tests(after, tmp_path)
        assert (
            _metric(after, "slurmft_slurm_command_duration_seconds_count", command="squeue") or 0
        ) >= 1
        print(
            f"READY {ready_s:.2f}s after exec; kill -> recovery on /metrics "
            f"{time.monotonic() - killed_at:.1f}s (scrape loop {took:.1f}s)"
        )
        print(
            "\n".join(
                line
                for line in after.splitlines()
                if line.startswith(
                    (
                        "slurmft_recoveries_total",
                        'slurmft_failures_total{kind="node_lost"}',
                        "slurmft_runs{",
                        "slurmft_drains_total",
                        "slurmft_slurm_command_duration_seconds_count",
                        "slurmft_detection_latency_seconds_sum",
                        "slurmft_build_info",
                    )
                )
            )
        )

        proc.send_signal(signal.SIGTERM)
        _receive(sock, "STOPPING=1", timeout_s=10)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        database.dispose()
