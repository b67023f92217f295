"""`slurmft daemon` as a process on the real local Slurm cluster: it sees a killed node through
its own loop, survives SIGKILL without repeating itself, and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, daemon_env, slurmft
from local_cluster import Cluster
from sqlalchemy import func, select
from support.waiting import wait_for_value

from slurmft.controller.intents import INTERRUPTED
from slurmft.controller.rpc import SOCKET_NAME, call
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind

pytestmark = pytest.mark.slurm


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return daemon_env(tmp_path)


@pytest.fixture
def daemon(env: dict[str, str], tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(env, tmp_path / "daemon.log")
    yield process
    process.stop_if_running()


def _count(database: Database, *where: object) -> int:
    with database.session() as s:
        return s.scalar(select(func.count()).select_from(Event).where(*where)) or 0


def test_daemon_loop_survives_sigkill_and_stops_on_sigterm(
    cluster: Cluster, env: dict[str, str], daemon: DaemonProcess, seed_run: Callable[..., None]
) -> None:
    slurmft(env, "db", "upgrade")
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
    wait_for_value(
        "the daemon to record the node loss",
        lambda: _count(database, *lost),
        lambda n: n >= 1,
        timeout_s=40,
    )
    print(f"kill -> node loss recorded by the daemon: {time.monotonic() - killed_at:.1f} s")

    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    daemon.start()  # a stale socket from the killed daemon is replaced
    # Killed between recording the loss and taking the node out of the run (each action is its
    # own transaction), the daemon takes it out on its first pass after the restart.
    status, _ = wait_for_value(
        "the node out of the run after the restart",
        lambda: call(socket_path, "status", run_id="rd"),
        lambda s: s["excluded_nodes"] == [victim],
        timeout_s=30,
    )
    assert status["excluded_nodes"] == [victim] and status["state"] == "running"
    time.sleep(3)  # several passes of the restarted daemon
    assert _count(database, *lost) == 1
    with database.session() as s:
        rows = [(a.kind, a.status, a.error) for a in s.scalars(select(Action))]
    # Excluded once. A SIGKILL that landed between the exclusion's intent and its outcome
    # leaves that row failed as interrupted (slurmft.controller.intents), decided again after.
    done = [r for r in rows if r[1] is ActionStatus.DONE]
    assert done == [(ActionKind.AGENT_LEAVE, ActionStatus.DONE, None)], rows
    assert all(r[2] == INTERRUPTED for r in rows if r not in done), rows

    assert daemon.kill(signal.SIGTERM) == 0
    assert not socket_path.exists()
    database.dispose()
