"""The whole loop on the real local Slurm cluster: `slurmft submit` under the daemon → a job of
3 nodes + 1 spare training the example → an active node killed → the spare takes over at the
same world size and the run keeps training; the daemon records why; SIGKILLed and restarted
mid-run it loses nothing and submits nothing twice; the run completes. And a run without any
failure completes with its spare unused."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import TINY, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.controller.intents import INTERRUPTED
from slurmft.controller.rpc import call
from slurmft.db.models import ActionKind, ActionStatus, Event, EventKind
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]


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
    """The spare is still waiting when training ends: the run is COMPLETED, not a failure."""
    run = submit(
        cluster,
        daemon,
        tmp_path,
        [*EXAMPLE, "--steps", "15", "--ckpt-every", "5", "--heartbeat-interval-s", "1"],
        name="happy",
    )
    final, _ = wait_for_value(
        "the run to end", run.run, lambda r: r.state.is_terminal, timeout_s=180
    )
    assert (final.state, final.end_reason) == (RunState.COMPLETED, "the training script finished")
    assert sorted({r["step"] for r in run.jsonl("losses.jsonl")}) == list(range(1, 16))
    run.database.dispose()
