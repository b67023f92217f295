"""The whole loop on the real local Slurm cluster: `slurmft submit` under the daemon → a job of
3 nodes + 1 spare training the example → an active node killed → the spare takes over at the
same world size and the run keeps training; the daemon records why; SIGKILLed and restarted
mid-run it loses nothing and submits nothing twice; the run completes."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_process import DaemonProcess, daemon_env, slurmft
from local_cluster import Cluster, wait_for
from sqlalchemy import func, select

from slurmft.controller.rpc import call
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, Event, EventKind, RankHeartbeat, Run
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

TINY = [
    "--steps",
    "60",
    "--ckpt-every",
    "5",
    "--work-ms",
    "150",
    "--heartbeat-interval-s",
    "1",
    "--pg-timeout-s",
    "30",
]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    env = daemon_env(tmp_path)
    slurmft(env, "db", "upgrade")
    process = DaemonProcess(env, tmp_path / "daemon.log")
    process.start()
    yield process
    process.stop_if_running()


def _losses(out: Path) -> list[dict[str, Any]]:
    path = out / "losses.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _beating_nodes(database: Database, run_id: str) -> dict[int, str]:
    with database.session() as s:
        rows = s.scalars(select(RankHeartbeat).where(RankHeartbeat.run_id == run_id)).all()
        return {hb.rank: hb.node for hb in rows}


def test_submit_kill_a_node_spare_takes_over_daemon_restart_run_completes(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    out = shared / "out"
    submitted = json.loads(
        slurmft(
            daemon.env,
            "submit",
            "--nodes",
            "3",
            "--spares",
            "1",
            "--ckpt-dir",
            str(shared / "ckpt"),
            "--name",
            "e2e",
            "--json",
            "--",
            "-m",
            "slurmft.train.examples.tiny",
            "--ckpt-dir",
            str(shared / "ckpt"),
            "--out-dir",
            str(out),
            *TINY,
        )
    )
    run_id, job_id = submitted["run_id"], submitted["job_id"]
    cluster._jobs.append(job_id)  # cancelled by the fixture whatever happens
    database = Database(f"sqlite:///{daemon.env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    log = lambda: (shared / "ckpt" / ".slurmft").glob("slurm-*.out")  # noqa: E731
    job_log = lambda: "\n".join(p.read_text(errors="replace") for p in log())  # noqa: E731

    wait_for(
        "training, reported by three ranks",
        lambda: _beating_nodes(database, run_id),
        lambda ranks: len(ranks) == 3 and any(r["step"] >= 10 for r in _losses(out)),
        timeout_s=180,
    )
    status = call(daemon.socket_path, "status", run_id=run_id)
    assert (status["state"], status["job_id"]) == ("running", job_id)

    batch_host = cluster.client.job(job_id).batch_host
    active = set(_beating_nodes(database, run_id).values())
    victim = sorted(active - {batch_host})[0]
    cluster.kill_node(victim)
    wait_for(
        "the daemon to record the loss",
        lambda: _count(database, Event.kind == EventKind.NODE_LOST, Event.node == victim),
        lambda n: n == 1,
        timeout_s=60,
    )

    daemon.kill(signal.SIGKILL)  # mid-run; it must pick up where it was
    daemon.start()
    wait_for(
        "the spare to train in its place",
        lambda: _beating_nodes(database, run_id),
        lambda ranks: victim not in ranks.values() and len(ranks) == 3,
        timeout_s=120,
    )

    wait_for(
        "the run to complete",
        lambda: _run(database, run_id).state,
        lambda state: state is RunState.COMPLETED,
        timeout_s=240,
    )
    records = _losses(out)
    assert {r["world_size"] for r in records} == {3}
    assert sorted({r["step"] for r in records}) == list(range(1, 61)), job_log()[-2000:]
    assert _count(database, Event.kind == EventKind.NODE_LOST) == 1  # not repeated by restarts
    with database.session() as s:
        leaves = s.scalars(select(Action).where(Action.kind == ActionKind.AGENT_LEAVE)).all()
        assert [a.node for a in leaves] == [victim] and victim in leaves[0].reason
    assert len(cluster.client.jobs([job_id])) == 1  # one job for the run, never resubmitted
    database.dispose()


def _count(database: Database, *where: object) -> int:
    with database.session() as s:
        return s.scalar(select(func.count()).select_from(Event).where(*where)) or 0


def _run(database: Database, run_id: str) -> Run:
    with database.session() as s:
        run = s.get(Run, run_id)
        assert run is not None
        return run


def test_a_run_without_failures_completes_with_its_spare_unused(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The spare is still waiting when training ends: the run is COMPLETED, not a failure."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    submitted = json.loads(
        slurmft(
            daemon.env,
            "submit",
            "--nodes",
            "3",
            "--spares",
            "1",
            "--ckpt-dir",
            str(shared / "ckpt"),
            "--name",
            "happy",
            "--json",
            "--",
            "-m",
            "slurmft.train.examples.tiny",
            "--ckpt-dir",
            str(shared / "ckpt"),
            "--out-dir",
            str(shared / "out"),
            "--steps",
            "15",
            "--ckpt-every",
            "5",
            "--heartbeat-interval-s",
            "1",
        )
    )
    cluster._jobs.append(submitted["job_id"])
    database = Database(f"sqlite:///{daemon.env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    run, _ = wait_for(
        "the run to end",
        lambda: _run(database, submitted["run_id"]),
        lambda r: r.state.is_terminal,
        timeout_s=180,
    )
    assert (run.state, run.end_reason) == (RunState.COMPLETED, "the training script finished")
    assert sorted({r["step"] for r in _losses(shared / "out")}) == list(range(1, 16))
    database.dispose()
