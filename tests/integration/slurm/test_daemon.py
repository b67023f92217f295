"""`slurmft daemon` as a process on the real local Slurm cluster: it sees a killed node through
its own loop, survives SIGKILL without repeating itself, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from local_cluster import Cluster, wait_for
from sqlalchemy import func, select

from slurmft.controller.rpc import SOCKET_NAME, DaemonUnreachable, call
from slurmft.db import Database
from slurmft.db.models import Action, Event, EventKind

pytestmark = pytest.mark.slurm


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    return base | {
        "SLURMFT_PATHS_STATE_DIR": str(tmp_path / "state"),
        "SLURMFT_PATHS_RUNTIME_DIR": str(tmp_path / "run"),
        "SLURMFT_DAEMON_POLL_INTERVAL_S": "1",
        "SLURMFT_DAEMON_INGEST_LISTEN": "127.0.0.1:0",
        "SLURMFT_SLURM_CONF": os.environ["SLURM_CONF"],
    }


def _slurmft(env: dict[str, str], *argv: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "slurmft", *argv],
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )


class DaemonProcess:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slurmft", "daemon"], env=self.env, stdout=out, stderr=out
            )
        wait_for("the daemon to answer on its socket", self._answers, bool, timeout_s=30)

    def _answers(self) -> bool:
        self._alive()
        try:
            call(Path(self.env["SLURMFT_PATHS_RUNTIME_DIR"]) / SOCKET_NAME, "runs")
        except DaemonUnreachable:
            return False  # not up yet, or a stale socket left by a killed daemon
        return True

    def _alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"daemon exited {self.proc.returncode}:\n{self.log.read_text()}")
        return True

    def kill(self, signum: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=30)


@pytest.fixture
def daemon(env: dict[str, str], tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(env, tmp_path / "daemon.log")
    yield process
    if process.proc is not None and process.proc.poll() is None:
        process.kill(signal.SIGKILL)


def _count(database: Database, *where: object) -> int:
    with database.session() as s:
        return s.scalar(select(func.count()).select_from(Event).where(*where)) or 0


def test_daemon_loop_survives_sigkill_and_stops_on_sigterm(
    cluster: Cluster, env: dict[str, str], daemon: DaemonProcess, seed_run: Callable[..., None]
) -> None:
    _slurmft(env, "db", "upgrade")
    database = Database(f"sqlite:///{env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    job_id = cluster.submit(
        ["sleep", "300"], nodes=3, spare_nodes=1, run_id="rd", ntasks_per_node=1
    )
    job, _ = cluster.wait_running(job_id)
    seed_run(database, "rd", job_id=job_id)

    daemon.start()
    socket_path = Path(env["SLURMFT_PATHS_RUNTIME_DIR"]) / SOCKET_NAME
    assert [r["run_id"] for r in call(socket_path, "runs")] == ["rd"]

    victim = next(n for n in job.nodes if n != job.batch_host)
    killed_at = time.monotonic()
    cluster.kill_node(victim)
    lost = (Event.kind == EventKind.NODE_LOST, Event.node == victim)
    wait_for(
        "the daemon to record the node loss",
        lambda: _count(database, *lost),
        lambda n: n >= 1,
        timeout_s=40,
    )
    print(f"kill -> node loss recorded by the daemon: {time.monotonic() - killed_at:.1f} s")

    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    daemon.start()  # a stale socket from the killed daemon is replaced
    status = call(socket_path, "status", run_id="rd")
    assert status["excluded_nodes"] == [victim] and status["state"] == "running"
    time.sleep(3)  # several passes of the restarted daemon
    assert _count(database, *lost) == 1
    with database.session() as s:
        assert s.scalar(select(func.count()).select_from(Action)) == 1  # excluded once

    assert daemon.kill(signal.SIGTERM) == 0
    assert not socket_path.exists()
    database.dispose()
