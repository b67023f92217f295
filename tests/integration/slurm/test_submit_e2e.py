"""The whole loop on the real local Slurm cluster: `slurmft submit` under the daemon → a job of
3 nodes + 1 spare training the example → an active node killed → the spare takes over at the
same world size and the run keeps training; the daemon records why; SIGKILLed and restarted
mid-run it loses nothing and submits nothing twice; the run completes. And a run without any
failure, submitted and followed through the Python API, completes with its spare unused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import TINY, SubmittedRun, submit
from local_cluster import Cluster
from sqlalchemy import func, select, text
from support.waiting import wait_for_value

from slurmft.controller.intents import INTERRUPTED
from slurmft.controller.rpc import call
from slurmft.db import Database
from slurmft.db.models import ActionKind, ActionStatus, Event, EventKind, Run, StepTime
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]
API_CLIENT = Path(__file__).with_name("api_client.py")


def test_submit_kill_a_node_spare_takes_over_daemon_restart_run_completes(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(cluster, daemon, tmp_path, [*EXAMPLE, *TINY], name="e2e")
    run.wait_training()
    status = call(daemon.socket_path, "status", run_id=run.run_id)
    assert (status["state"], status["job_id"]) == ("running", run.job_id)

    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
    cluster.kill_node(victim)
    lost = (Event.kind == EventKind.NODE_LOST, Event.node == victim)
    wait_for_value(
        "the daemon to record the loss",
        lambda: run.count_events(*lost),
        lambda n: n == 1,
        timeout_s=60,
    )

    daemon.kill(signal.SIGKILL)  # mid-run; it must pick up where it was
    daemon.start()
    run.wait_replaced(victim)

    wait_for_value(
        "the run to complete",
        lambda: run.run().state,
        lambda state: state is RunState.COMPLETED,
        timeout_s=240,
    )
    records = run.jsonl("losses.jsonl")
    assert {r["world_size"] for r in records} == {3}
    assert sorted({r["step"] for r in records}) == list(range(1, 61)), run.job_log()[-2000:]
    assert run.count_events(Event.kind == EventKind.NODE_LOST) == 1  # not repeated by restarts
    leaves = [a for a in run.actions() if a.kind is ActionKind.AGENT_LEAVE]
    # The daemon may be killed between a leave's intent and its outcome: that row is settled
    # as interrupted after the restart, and the leave decided and done again.
    done = [a for a in leaves if a.status is ActionStatus.DONE]
    assert [a.node for a in done] == [victim] and victim in done[0].reason
    assert all(a.error == INTERRUPTED for a in leaves if a not in done), leaves
    assert len(cluster.client.jobs([run.job_id])) == 1  # one job for the run, never resubmitted
    run.database.dispose()


def test_a_run_without_failures_completes_with_its_spare_unused(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Submitted and followed through the Python API, by a user's script
    (docs/python-api.md). The spare is still waiting when training ends: the run is
    COMPLETED, not a failure."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    ckpt, out = shared / "ckpt", shared / "out"
    spec = {
        "name": "happy",
        "nodes": 3,
        "spares": 1,
        "ckpt_dir": str(ckpt),
        "script": [*EXAMPLE[:2], "--ckpt-dir", str(ckpt), "--out-dir", str(out),
                   "--steps", "15", "--ckpt-every", "5", "--heartbeat-interval-s", "1"],
    }  # fmt: skip
    client = subprocess.Popen(
        [sys.executable, str(API_CLIENT), json.dumps(spec)],
        env=daemon.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    first = client.stdout.readline()
    if not first:
        pytest.fail(f"the API client submitted nothing: {client.communicate(timeout=10)[1]}")
    submitted = json.loads(first)
    cluster._jobs.append(submitted["job_id"])  # cancelled by the fixture whatever happens
    rest, err = client.communicate(timeout=240)
    assert client.returncode == 0, err
    followed = json.loads(rest)
    database = Database(f"sqlite:///{daemon.env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    run = SubmittedRun(submitted["run_id"], submitted["job_id"], shared, database)

    final = followed["final"]
    assert (final["state"], final["end_reason"]) == ("completed", "the training script finished")
    assert (final["run_id"], final["job_id"], followed["spares"]) == (run.run_id, run.job_id, 1)
    assert run.run().state is RunState.COMPLETED  # what the API said is what the store holds
    # The timeline it followed holds the run's checkpoints and its end, in time order.
    kinds = [entry["kind"] for entry in followed["entries"]]
    assert "checkpoint" in kinds and kinds[-1] == "finish_run", kinds
    times = [entry["at"] for entry in followed["entries"]]
    assert times == sorted(times)
    records = run.jsonl("losses.jsonl")
    assert sorted({r["step"] for r in records}) == list(range(1, 16))
    # Its effective ratio is whole, and its wall time is its steps' span, ended with them.
    first_read, _ = wait_for_value(
        "the run's wall time to end with its last step",
        lambda: _effective(run, ranks=3),
        lambda row: row[1] is not None,
    )
    time.sleep(2)
    wall, ratio = _effective(run, ranks=3)
    assert (wall, ratio) == first_read
    assert ratio is not None and ratio >= 0.995
    assert wall == pytest.approx(records[-1]["time"] - records[0]["time"], abs=3.0)
    run.database.dispose()


def _effective(run: SubmittedRun, ranks: int) -> tuple[float, float | None]:
    """The run's wall time and effective ratio in run_effective_time, once its step span is
    complete (None before): every rank's last step stored, and the span read up to the last of
    them. Each agent sends its ranks' steps in its own batches: the first one in is not the
    span's end (a rank ends the same step milliseconds later)."""
    with run.database.session() as s:
        stored = s.get(Run, run.run_id)
        last = s.scalar(select(func.max(StepTime.step)).where(StepTime.run_id == run.run_id))
        ends = s.scalars(
            select(StepTime.ended_at).where(StepTime.run_id == run.run_id, StepTime.step == last)
        ).all()
        done = (
            stored is not None
            and stored.last_step_at is not None
            and len(ends) == ranks
            and stored.last_step_at >= max(ends)
        )
        row = s.execute(
            text("SELECT wall_s, effective_ratio FROM run_effective_time WHERE run_id = :r"),
            {"r": run.run_id},
        ).one()
    return float(row.wall_s), float(row.effective_ratio) if done else None
