"""A node lost while the daemon is down, on the real local Slurm cluster: the run's spare takes
over on its own (torchrun's rendezvous), and Slurm shrinks the job; when the daemon is back,
it reconciles the job with the allocation it stored and records what it missed: the loss, the
node's exclusion, and the restart it caused, free."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import EXAMPLE, SubmittedRun, submit
from local_cluster import Cluster
from sqlalchemy import select
from support.processes import workers
from support.waiting import wait_for_value

from slurmft.db.models import ActionKind, AllocationNode, Attempt, Event, EventKind, FaultClass
from slurmft.db.records import denied_nodes
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

DOWN_S = 75  # longer than a restart's cause window (60 s): the loss is no longer news


def _steps(count: int) -> list[str]:
    """The example for ``count`` steps of 150 ms: long enough to outlive the outage."""
    return [*EXAMPLE, "--steps", str(count), "--work-ms", "150"]


def _allocation(run: SubmittedRun) -> set[str]:
    with run.database.session() as s:
        return set(s.scalars(select(AllocationNode.node).join(Attempt).where(
            Attempt.run_id == run.run_id, AllocationNode.left_at.is_(None))))  # fmt: skip


def _worker_nodes(run: SubmittedRun) -> set[str]:
    """The nodes the run's training processes run on, from their own environment (all nodes
    run on this host): what the store cannot tell while the daemon is down. A worker runs the
    example's module itself; the spare's torchrun, waiting to join, names it only as the script
    it would start (killing that node would cost the run nothing)."""
    found = set()
    for _pid, _argv, environ in workers("slurmft.train.examples.tiny", str(run.ckpt_dir).encode()):
        found |= {v[len(b"SLURMD_NODENAME="):].decode() for v in environ
                  if v.startswith(b"SLURMD_NODENAME=")}  # fmt: skip
    return found


def test_a_node_lost_while_the_daemon_is_down_is_recorded_when_it_is_back(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    # 700 steps: still training when the daemon is back (a node loss now costs seconds)
    run = submit(cluster, daemon, tmp_path, _steps(700), name="daemon-down")
    run.wait_training()
    wait_for_value("the allocation stored", lambda: _allocation(run), lambda n: len(n) == 4)
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]

    daemon.kill(signal.SIGTERM)
    _lose_node_while_the_daemon_is_down(cluster, daemon, run, victim, steps=700)


def test_a_node_lost_before_the_daemon_ever_saw_the_job_run_is_recorded_when_it_is_back(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The daemon went down before the job started: it never saw the whole allocation, and when
    it is back Slurm names only the nodes left. The batch step's report, late, names the lost
    node too, and the agent step's record in Slurm confirms the job had it."""
    begin = ["--begin=now+15"]  # the job waits until the daemon is down
    # Longer: the agent step must still run when the daemon is back (its record is the proof).
    run = submit(cluster, daemon, tmp_path, _steps(700), name="daemon-down-early",
                 fields={"sbatch_args": begin})  # fmt: skip
    daemon.kill(signal.SIGTERM)
    (attempt,) = run.attempts()
    assert (attempt.started_at, attempt.nodelist, _allocation(run)) == (None, None, set())
    wait_for_value("training to start", run.latest_step, lambda step: step >= 10, timeout_s=180)
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(_worker_nodes(run) - {batch_host})[0]
    _lose_node_while_the_daemon_is_down(cluster, daemon, run, victim, steps=700)


def _denied(run: SubmittedRun) -> frozenset[str]:
    with run.database.session() as s:
        return denied_nodes(s, run_id=run.run_id)


def _lose_node_while_the_daemon_is_down(
    cluster: Cluster, daemon: DaemonProcess, run: SubmittedRun, victim: str, *, steps: int
) -> None:
    """Kill ``victim`` (it trains, it is not the batch host) while the daemon is down, then
    start the daemon: it records the loss, the exclusion and a free restart."""
    stopped_at = time.monotonic()
    cluster.kill_node(victim)
    # The spare joins the rendezvous on its own: training goes on (the store hears nothing of
    # it while the daemon is down, so the example's own step log tells).
    at_kill = run.latest_step()
    wait_for_value("training to go on without the node", run.latest_step,
                   lambda step: step > at_kill + 20, timeout_s=150)  # fmt: skip
    wait_for_value(
        "Slurm to take the node from the job",
        lambda: cluster.client.job(run.job_id).nodes,
        lambda nodes: victim not in nodes,
        timeout_s=60,
    )
    time.sleep(max(0.0, DOWN_S - (time.monotonic() - stopped_at)))
    assert run.count_events(Event.kind == EventKind.NODE_LOST) == 0

    daemon.start()
    (lost,), _ = wait_for_value(
        "the daemon to record the loss it missed",
        lambda: run.events(Event.kind == EventKind.NODE_LOST),
        bool,
        timeout_s=60,
    )
    assert (lost.node, lost.fault_class) == (victim, FaultClass.HARDWARE)
    excluded, _ = wait_for_value(
        "the node's exclusion from the run",
        lambda: [a for a in run.actions() if a.kind is ActionKind.AGENT_LEAVE],
        bool,
        timeout_s=30,
    )
    assert {a.node for a in excluded} == {victim}
    # The action is recorded as planned before its effect: the denylist entry follows it.
    wait_for_value("the node on the run's denylist", lambda: _denied(run),
                   lambda denied: victim in denied, timeout_s=30)  # fmt: skip
    restarts, _ = wait_for_value(
        "the restart the loss caused, counted",
        lambda: run.events(Event.kind == EventKind.RESTART, Event.source == "daemon"),
        bool,
        timeout_s=60,
    )
    assert [(r.fault_class, r.details.get("free")) for r in restarts] == [
        (FaultClass.HARDWARE, True)
    ], [r.details for r in restarts]
    assert run.run().restarts_without_progress == 0
    run.wait_completed(steps, timeout_s=300)
    assert run.run().state is RunState.COMPLETED
    run.database.dispose()
