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
from support.waiting import wait_for_value

from slurmft.db.models import ActionKind, AllocationNode, Attempt, Event, EventKind, FaultClass
from slurmft.db.records import denied_nodes
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

DOWN_S = 75  # longer than a restart's cause window (60 s): the loss is no longer news


def _allocation(run: SubmittedRun) -> set[str]:
    with run.database.session() as s:
        return set(s.scalars(select(AllocationNode.node).join(Attempt).where(
            Attempt.run_id == run.run_id, AllocationNode.left_at.is_(None))))  # fmt: skip


def test_a_node_lost_while_the_daemon_is_down_is_recorded_when_it_is_back(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    steps = ["--steps", "400", "--work-ms", "150"]  # long enough to outlive the outage
    run = submit(cluster, daemon, tmp_path, [*EXAMPLE, *steps], name="daemon-down")
    run.wait_training()
    wait_for_value("the allocation stored", lambda: _allocation(run), lambda n: len(n) == 4)
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]

    daemon.kill(signal.SIGTERM)
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
    with run.database.session() as s:
        assert denied_nodes(s, run_id=run.run_id) >= {victim}
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
    run.wait_completed(400, timeout_s=300)
    assert run.run().state is RunState.COMPLETED
    run.database.dispose()
