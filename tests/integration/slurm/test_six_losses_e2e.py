"""A run that loses six nodes one after another, with progress (a newer checkpoint) between the
losses, keeps going and completes: a restart caused by a node that was then removed is free.

A 2+1 run on its own nine-node cluster (nine: each requeue needs three nodes no loss has touched).
Each loss kills an active node that is not the batch host, once a checkpoint newer than the one
at the previous loss exists. While the job holds a spare, the spare takes over inside the
allocation; with no spare left the job is requeued (same job id, a new attempt) without the dead
nodes. Expected: spare, requeue, spare, requeue, spare, requeue."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, running_daemon
from e2e_run import TINY, SubmittedRun, submit
from local_cluster import Cluster
from slurm_clusters import own_cluster
from support.waiting import wait_for_value

from slurmft.agent.batch import newest_checkpoint
from slurmft.db.models import Action, ActionKind, Event, EventKind
from slurmft.db.states import RunState
from slurmft.slurm.cli_backend import CliSlurmClient

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

NODES, SPARES, LOSSES, STEPS = 2, 1, 6, 150
CLUSTER_NODES = 9
EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]


@pytest.fixture(scope="module")
def loss_conf() -> Iterator[Path]:
    """A cluster of its own (the suite's has six nodes); SLURMFT_LOSS_CLUSTER_ROOT picks its
    root."""
    root = os.environ.get("SLURMFT_LOSS_CLUSTER_ROOT")
    with own_cluster(CLUSTER_NODES, prefix="sftl-", root=root) as own:
        yield Path(own.conf)


@pytest.fixture
def loss_cluster(loss_conf: Path, tmp_path: Path) -> Iterator[Cluster]:
    tmp_path.chmod(0o777)
    cluster = Cluster(CliSlurmClient(slurm_conf=str(loss_conf), timeout_s=20), loss_conf, tmp_path)
    try:
        yield cluster
    finally:
        cluster.undo()


@pytest.fixture
def loss_daemon(loss_conf: Path, tmp_path: Path) -> Iterator[DaemonProcess]:
    conf = str(loss_conf)
    with running_daemon(tmp_path, SLURM_CONF=conf, SLURMFT_SLURM_CONF=conf) as process:
        yield process


def _newer_checkpoint(run: SubmittedRun, than: str) -> float:
    """Seconds until a checkpoint newer than `than` exists: the run trains again."""
    _, seconds = wait_for_value(
        f"a checkpoint newer than {than or 'none'}",
        lambda: newest_checkpoint(str(run.ckpt_dir)),
        lambda newest: newest > than,
        timeout_s=180,
    )
    return seconds


def _lose_a_node(cluster: Cluster, run: SubmittedRun, lost: list[str]) -> str:
    """Kill an active node other than the batch host; returns how the run is to recover."""
    job = cluster.client.job(run.job_id)
    held = [n for n in job.nodes if n not in lost]
    # Every rank's newest heartbeat from a node the job holds now: after a requeue a rank's row
    # names its node of the last attempt until the new attempt's first beat is stored, and that
    # may come after its first checkpoint (seen on a loaded machine: a node no longer in the job
    # was "killed", and its loss was never recorded).
    beating, _ = wait_for_value(
        f"every rank beating from the job's nodes {held}",
        run.beating_nodes,
        lambda ranks: len(ranks) == NODES and set(ranks.values()) <= set(held),
        timeout_s=60,
    )
    active = sorted(set(beating.values()) - {job.batch_host})
    assert active, f"no active node to kill besides the batch host {job.batch_host}: {held}"
    victim = active[0]
    cluster.kill_node(victim)
    lost.append(victim)
    return "spare" if len(held) > NODES else "requeue"


def test_six_node_losses_with_progress_between_them_do_not_stop_the_run(
    loss_cluster: Cluster, loss_daemon: DaemonProcess, tmp_path: Path
) -> None:
    started = time.monotonic()
    script = [*EXAMPLE, *TINY, "--steps", str(STEPS)]
    run = submit(
        loss_cluster, loss_daemon, tmp_path, script, name="six-losses", nodes=NODES, spares=SPARES
    )
    wait_for_value(
        "training on two ranks",
        run.beating_nodes,
        lambda ranks: len(ranks) == NODES,
        timeout_s=180,
    )
    lost: list[str] = []
    ways: list[str] = []
    checkpoint = ""
    _newer_checkpoint(run, checkpoint)
    for _ in range(LOSSES):
        ways.append(_lose_a_node(loss_cluster, run, lost))
        # No save completes once a rank is gone (saves are collective): the next loss waits
        # for one newer than this.
        checkpoint = newest_checkpoint(str(run.ckpt_dir))
        _, detected_s = wait_for_value(
            f"the daemon to record the loss of {lost[-1]}",
            lambda: {e.node for e in run.events(Event.kind == EventKind.NODE_LOST)},
            lambda nodes: lost[-1] in nodes,
            timeout_s=90,
        )
        trains_s = detected_s + _newer_checkpoint(run, checkpoint)
        print(
            f"\nloss {len(lost)}: {lost[-1]} ({ways[-1]}): recorded after {detected_s:.0f} s, "
            f"a newer checkpoint {trains_s:.0f} s after the kill"
        )
        assert run.run().state is not RunState.STOPPED, run.run().end_reason

    final, _ = wait_for_value(
        "the run to end", run.run, lambda r: r.state.is_terminal, timeout_s=300
    )
    print(
        f"six losses {ways}: run {final.state.value} after {time.monotonic() - started:.0f} s, "
        f"{final.restarts_without_progress} restarts without progress counted"
    )
    assert final.state is RunState.COMPLETED, final.end_reason
    assert ways == ["spare", "requeue"] * 3
    daemon_lost = run.events(Event.kind == EventKind.NODE_LOST, Event.source == "daemon")
    assert sorted(e.node for e in daemon_lost) == sorted(lost)
    assert not run.actions(Action.kind == ActionKind.STOP_RUN)
    attempts = run.attempts()
    assert {a.slurm_job_id for a in attempts} == {run.job_id}  # requeued, never resubmitted
    assert len(attempts) == 1 + ways.count("requeue"), [a.end_reason for a in attempts]
    records = run.jsonl("losses.jsonl")
    assert {r["world_size"] for r in records} == {NODES}
    assert sorted({r["step"] for r in records}) == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    run.database.dispose()
