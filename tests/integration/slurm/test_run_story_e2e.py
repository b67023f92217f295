"""`slurmft status`, `runs`, `events --follow`, `logs --follow` and `report` on a live run on
the real local Slurm cluster: a 3 + 1 run of the example loses a node mid-run; the commands say
where it is while it trains, the followers print what happens as it happens and stop by
themselves when the run has ended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, slurmft
from e2e_run import EXAMPLE, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def _follower(daemon: DaemonProcess, out: Path, *argv: str) -> subprocess.Popen[bytes]:
    with out.open("wb") as stream:
        return subprocess.Popen(
            [sys.executable, "-m", "slurmft", *argv], env=daemon.env, stdout=stream,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def test_the_commands_tell_a_live_runs_story(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    steps = ["--steps", "150", "--work-ms", "150"]
    run = submit(cluster, daemon, tmp_path, [*EXAMPLE, *steps], name="story")
    run.wait_training(past_step=12)
    events_out, logs_out = tmp_path / "events.jsonl", tmp_path / "logs.txt"
    events = _follower(daemon, events_out, "events", run.run_id, "--follow", "--json")
    logs = _follower(daemon, logs_out, "logs", run.run_id, "--follow")
    try:
        # The status is the store's, a report interval or two behind the ranks' own log.
        status, _ = wait_for_value(
            "status to show a checkpoint, three ranks and step 10",
            lambda: json.loads(slurmft(daemon.env, "status", run.run_id, "--json")),
            lambda s: s["checkpoint"] is not None and s["world_size"] == 3 and s["step"] >= 10,
            timeout_s=60,
        )
        assert status["state"] == "running" and status["step"] >= 10
        assert status["checkpoint"]["verified"] and status["checkpoint"]["age_s"] >= 0
        assert (status["spares_left"], status["restarts"]) == (1, 0)
        assert status["restart_cap"] >= 1 and status["doing"] == "watching 3 ranks"
        text = slurmft(daemon.env, "status", run.run_id)
        assert "spares left: 1 of 1" in text and "now: watching 3 ranks" in text
        (line,) = slurmft(daemon.env, "runs", "--state", "running").splitlines()
        assert line.startswith(run.run_id) and "world 3" in line and "restarts 0/" in line

        batch_host = cluster.client.job(run.job_id).batch_host
        victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
        cluster.kill_node(victim)
        run.wait_replaced(victim)
        report = tmp_path / "live.png"
        said = slurmft(daemon.env, "report", run.run_id, "--out", str(report))
        assert report.stat().st_size > 0 and "3 ranks" in said
        run.wait_completed(150)
        assert events.wait(timeout=60) == 0, events_out.read_text()[-2000:]
        assert logs.wait(timeout=60) == 0, logs_out.read_text()[-2000:]
    finally:
        for follower in (events, logs):
            if follower.poll() is None:
                follower.kill()
                follower.wait()

    told = [json.loads(line) for line in events_out.read_text().splitlines() if line.strip()]
    kinds = [(e["source"], e["kind"]) for e in told]
    lost = kinds.index(("event", "node_lost"))
    assert told[lost]["nodes"] == [victim]
    leave = kinds.index(("action", "agent_leave"))
    assert lost < leave and told[leave]["nodes"] == [victim]
    assert ("action", "finish_run") in kinds[leave:]  # followed to the end
    # Asked afterwards, in one answer: every agent's report of the restart is one line.
    whole = json.loads(slurmft(daemon.env, "events", run.run_id, "--json"))["entries"]
    restarts = [e for e in whole if e["kind"] == "restart" and e["reporter"] == "agent"]
    assert restarts and max(e["count"] for e in restarts) >= 2, restarts
    output = logs_out.read_text()
    assert f"agent[{victim}]" in output and "training finished" in output
    # Each worker line names its global rank; --rank keeps one rank's, without the label: the
    # example's line at each start (the first, and the one after the node was lost).
    assert "[rank1]: rank 1 of 3 training from step 0\n" in output
    ranked = slurmft(daemon.env, "logs", run.run_id, "--rank", "1").splitlines()
    starts = [line for line in ranked if line.startswith("rank 1 of 3 training from step ")]
    assert len(starts) == 2 and starts[0].endswith("step 0"), ranked
    assert not [line for line in ranked if "agent[" in line or line.startswith("rank 0 ")]
    assert run.run().state is RunState.COMPLETED
    run.database.dispose()
