"""A killed batch host on the real local Slurm cluster. Under `--no-kill` Slurm keeps such a job
RUNNING forever (notes/local-slurm.md): the daemon must see that the node holding the batch
step is gone and requeue the job without it. The requeued job (same job id, a new attempt) runs
on the other nodes, resumes from the last checkpoint at the same world size, and completes.

And a batch host that Slurm calls not responding for a moment (its slurmd stopped for a few
seconds, its steps running on) costs nothing: Slurm's word is acted on only once confirmed
(policy.confirm_s, or the node's agent silent as long)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, running_daemon, slurmft
from e2e_run import EXAMPLE, TINY, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind
from slurmft.db.states import AttemptState, RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_killed_batch_host_is_requeued_without_it_and_the_run_completes(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(
        cluster,
        daemon,
        tmp_path,
        ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", *TINY],
        name="batch-host",
        spares=0,  # the requeue, not a spare, is what brings this run back
    )
    run.wait_training()
    first_nodes = set(cluster.client.job(run.job_id).nodes)
    batch_host = cluster.client.job(run.job_id).batch_host
    assert batch_host in first_nodes

    cluster.kill_node(batch_host)
    killed_at = time.monotonic()
    events, detected_s = wait_for_value(
        "the daemon to record the batch host down",
        lambda: run.events(Event.kind == EventKind.BATCH_HOST_DOWN),
        lambda found: len(found) == 1,
        timeout_s=60,
    )
    assert events[0].node == batch_host
    requeues, _ = wait_for_value(
        "the daemon to requeue the job",
        lambda: run.actions(Action.kind == ActionKind.REQUEUE),
        lambda found: any(a.status is not ActionStatus.PLANNED for a in found),
        timeout_s=30,
    )
    assert [a.status for a in requeues] == [ActionStatus.DONE], [a.error for a in requeues]
    assert batch_host in requeues[0].reason and "batch host" in requeues[0].reason

    attempts, _ = wait_for_value(
        "the requeued job running again, a second attempt",
        run.attempts,
        lambda found: len(found) == 2 and found[1].state is AttemptState.RUNNING,
        timeout_s=90,
    )
    running_again_s = time.monotonic() - killed_at
    first, second = attempts
    assert first.state is AttemptState.REQUEUED
    assert (second.number, second.slurm_job_id) == (2, run.job_id)
    second_nodes = set(cluster.client.job(run.job_id).nodes)
    assert batch_host not in second_nodes and len(second_nodes) == 3, second_nodes
    assert batch_host not in (second.nodelist or "") and second.batch_host != batch_host
    assert batch_host in cluster.client.job(run.job_id).excluded_nodes

    wait_for_value(
        "the run to complete",
        lambda: run.run().state,
        lambda state: state is RunState.COMPLETED,
        timeout_s=240,
    )
    losses = run.jsonl("losses.jsonl")
    assert {r["world_size"] for r in losses} == {3}
    assert sorted({r["step"] for r in losses}) == list(range(1, 61)), run.job_log()[-2000:]
    resumed = [e for e in run.jsonl("events.jsonl") if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] >= 10 and resumed[0]["world_size"] == 3, resumed
    assert len(run.events(Event.kind == EventKind.BATCH_HOST_DOWN)) == 1  # not repeated
    # The requeue stopped the healthy nodes' agents: never a loss of those nodes.
    lost = {e.node for e in run.events(Event.kind == EventKind.NODE_LOST)}
    assert lost <= {batch_host}, lost
    assert len(cluster.client.jobs([run.job_id])) == 1  # requeued, never resubmitted
    # The job's log keeps the killed attempt (Slurm truncates a requeued job's output unless
    # it is opened for appending): `slurmft logs --attempt 1` shows where it ran.
    first = slurmft(daemon.env, "logs", run.run_id, "--attempt", "1")
    assert f"batch step of job {run.job_id}, Slurm restart 0, on " in first, first[-2000:]
    assert "Slurm restart 1" not in first
    assert "Slurm restart 1" in slurmft(daemon.env, "logs", run.run_id)
    print(
        f"batch host {batch_host} killed: event after {detected_s:.1f} s, "
        f"running again on {sorted(second_nodes)} after {running_again_s:.1f} s"
    )
    run.database.dispose()


def test_a_batch_host_not_responding_for_a_moment_costs_no_requeue(
    cluster: Cluster, tmp_path: Path
) -> None:
    # The default confirmation (two polls at the default 5 s): Slurm's not-responding lasts
    # from its failed ping until its next one answers, which here can be over 2 s.
    with running_daemon(tmp_path, SLURMFT_POLICY_CONFIRM_S="10") as daemon:
        run = submit(cluster, daemon, tmp_path, EXAMPLE, name="flicker", spares=0)
        run.wait_training()
        host = cluster.client.job(run.job_id).batch_host
        stopped_at = time.monotonic()
        with cluster.slurmd_stopped(host):
            # Continued as soon as Slurm says it: before Slurm's DOWN (SlurmdTimeout).
            _, silent_s = wait_for_value(
                "Slurm to call the batch host not responding",
                lambda: cluster.client.node(host).status,
                lambda status: not status.responding,
                timeout_s=20,
            )
        _, answered_s = wait_for_value(
            "the batch host answering again",
            lambda: cluster.client.node(host).status,
            lambda status: status.responding,
            timeout_s=30,
        )
        assert not cluster.client.node(host).status.down, "Slurm set it DOWN: stopped too long"
        run.wait_completed(60)
        job = cluster.client.job(run.job_id)
        assert (job.restarts, host in job.nodes) == (0, True), job
        # No loss on record, the daemon's or the agents'; and the batch step, which confirms
        # Slurm's word as the daemon does, kept its agent step (no agent was stopped).
        lost = (EventKind.BATCH_HOST_DOWN, EventKind.NODE_LOST, EventKind.AGENT_STOPPED)
        assert run.events(Event.kind.in_(lost)) == []
        kinds = {a.kind for a in run.actions()}
        assert not kinds & {ActionKind.REQUEUE, ActionKind.AGENT_LEAVE, ActionKind.EVICT_NODE}
        print(f"\nslurmd of batch host {host} stopped: not responding after {silent_s:.1f} s, "
              f"answering {answered_s:.1f} s after the SIGCONT "
              f"({time.monotonic() - stopped_at:.0f} s ago); no requeue, no exclusion")  # fmt: skip
        run.database.dispose()
