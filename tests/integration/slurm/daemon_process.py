"""`slurmft daemon` as a process for the Slurm tests: its own state, socket and ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from support.waiting import wait_for_value

from slurmft.controller.rpc import SOCKET_NAME, DaemonUnreachable, call
from slurmft.db import Database
from slurmft.db.models import Event, EventKind

if TYPE_CHECKING:
    from unix_users import UnixUser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a daemon (and of the slurmft commands that talk to it)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    return base | {
        "SLURMFT_PATHS_STATE_DIR": str(tmp_path / "state"),
        "SLURMFT_PATHS_RUNTIME_DIR": str(tmp_path / "run"),
        "SLURMFT_DAEMON_POLL_INTERVAL_S": "1",
        "SLURMFT_POLICY_CONFIRM_S": "2",  # two polls, as the defaults are
        # A fixed port: agents keep the URL they were given across daemon restarts.
        "SLURMFT_DAEMON_INGEST_LISTEN": f"127.0.0.1:{free_port()}",
        "SLURMFT_DAEMON_METRICS_LISTEN": "127.0.0.1:0",
        "SLURMFT_SLURM_CONF": os.environ["SLURM_CONF"],
        # A daemon that will not stop is sent SIGABRT (kill below): its threads' stacks go to
        # its log, so the failure says what it was waiting for.
        "PYTHONFAULTHANDLER": "1",
    }


def run_slurmft(
    env: dict[str, str], *argv: str, as_user: UnixUser | None = None
) -> subprocess.CompletedProcess[str]:
    """`slurmft ARGV` as this process, or as a test user (with that user's `slurmft`)."""
    if as_user is not None:
        return as_user.run([as_user.slurmft, *argv], env, timeout=60)
    return subprocess.run(
        [sys.executable, "-m", "slurmft", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def slurmft(env: dict[str, str], *argv: str, as_user: UnixUser | None = None) -> str:
    """`slurmft ARGV`'s output; it must succeed."""
    done = run_slurmft(env, *argv, as_user=as_user)
    assert done.returncode == 0, f"slurmft {' '.join(argv)}: {done.stderr}"
    return done.stdout


class DaemonProcess:
    def __init__(self, env: dict[str, str], log: Path, as_user: UnixUser | None = None) -> None:
        self.env = env
        self.log = log
        self.as_user = as_user  # None: this process's user (root in the suite)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        return Path(self.env["SLURMFT_PATHS_RUNTIME_DIR"]) / SOCKET_NAME

    def client_env(self) -> dict[str, str]:
        """What another user's `slurmft` needs to reach this daemon and Slurm (with
        `UnixUser.env`, which adds the user's identity and PATH)."""
        keys = ("SLURMFT_PATHS_RUNTIME_DIR", "SLURMFT_SLURM_CONF")
        return {key: self.env[key] for key in keys} | {"SLURM_CONF": os.environ["SLURM_CONF"]}

    def start(self) -> None:
        with self.log.open("ab") as out:
            if self.as_user is not None:
                argv = [self.as_user.slurmft, "daemon"]
                self.proc = self.as_user.popen(argv, self.env, stdout=out, stderr=out)
            else:
                argv = [sys.executable, "-m", "slurmft", "daemon"]
                self.proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=out)
        wait_for_value("the daemon to answer on its socket", self._answers, bool, timeout_s=30)

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"daemon exited {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            call(self.socket_path, "runs")
        except DaemonUnreachable:
            return False  # not up yet, or a stale socket left by a killed daemon
        return True

    def kill(self, signum: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack, logged
            self.proc.wait(timeout=30)
            tail = self.log.read_text(errors="replace")[-20000:]
            pytest.fail(f"daemon still running 30 s after {signal.Signals(signum).name}:\n{tail}")

    def stop_if_running(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@contextmanager
def running_daemon(
    tmp_path: Path, as_user: UnixUser | None = None, **env: str
) -> Iterator[DaemonProcess]:
    """A started daemon on a fresh SQLite store; ``env`` adds or overrides its variables.
    ``as_user``: run it as that test user (``tmp_path`` must then be theirs)."""
    full_env = daemon_env(tmp_path) | env
    slurmft(full_env, "db", "upgrade", as_user=as_user)
    process = DaemonProcess(full_env, tmp_path / "daemon.log", as_user)
    process.start()
    try:
        yield process
    finally:
        process.stop_if_running()
        record_peer_deaths(full_env)


# scripts/test collects every dead-peer declaration the suite's daemons stored (issue: none may
# be a false alarm), with the test that made it, and prints them at the end.
PEER_DEATHS_LOG_ENV = "SLURMFT_TEST_PEER_DEATHS"


def record_peer_deaths(env: dict[str, str]) -> None:
    log = os.environ.get(PEER_DEATHS_LOG_ENV, "")
    store = Path(env["SLURMFT_PATHS_STATE_DIR"]) / "slurmft.db"
    if not log or "SLURMFT_DATABASE_URL" in env or not store.exists():
        return
    database = Database(f"sqlite:///{store}")
    try:
        with database.session() as session:
            found = session.execute(
                select(Event.node, Event.message).where(Event.kind == EventKind.PEER_DEAD)
            ).all()
    except SQLAlchemyError:
        return  # a store the test broke on purpose says nothing
    finally:
        database.dispose()
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(log, "a") as stream:
        for node, message in found:
            stream.write(json.dumps({"test": test, "by": node, "message": message}) + "\n")
