"""Observe-only mode on the real local Slurm cluster: the daemon decides and records everything
and acts on nothing. A node of a 3+1 run is killed: the loss is an event, the decided actions
are rows marked skipped, nothing is drained in Slurm and nothing goes on a denylist; the spare
still takes over, because that recovery happens inside the allocation without the daemon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, running_daemon
from e2e_run import TINY, submit
from local_cluster import Cluster
from sqlalchemy import func, select
from support.waiting import wait_for_value

from slurmft.controller.act import OBSERVE_ONLY
from slurmft.db.models import Action, ActionKind, ActionStatus, DenylistEntry, Event, EventKind
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with running_daemon(tmp_path, SLURMFT_DAEMON_OBSERVE_ONLY="true") as process:
        yield process


def test_observe_only_records_the_node_loss_and_acts_on_nothing(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(
        cluster,
        daemon,
        tmp_path,
        ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", *TINY],
        name="observe-only",
    )
    run.wait_training()
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
    cluster.kill_node(victim)

    wait_for_value(
        "the daemon to record the loss",
        lambda: run.events(Event.kind == EventKind.NODE_LOST, Event.node == victim),
        lambda found: len(found) == 1,
        timeout_s=60,
    )
    actions, _ = wait_for_value(
        "the decided actions, recorded",
        run.actions,
        lambda found: any(a.node == victim for a in found),
        timeout_s=30,
    )
    assert all(a.status is ActionStatus.SKIPPED for a in actions), [
        (a.kind, a.status) for a in actions
    ]
    assert {a.error for a in actions} == {OBSERVE_ONLY} and OBSERVE_ONLY.startswith("observe-only")
    assert victim in next(a.reason for a in actions if a.node == victim)

    run.wait_replaced(victim)
    wait_for_value(
        "the run to complete",
        lambda: run.run().state,
        lambda state: state is RunState.COMPLETED,
        timeout_s=240,
    )
    losses = run.jsonl("losses.jsonl")
    assert {r["world_size"] for r in losses} == {3}
    assert sorted({r["step"] for r in losses}) == list(range(1, 61)), run.job_log()[-2000:]

    # Nothing was acted on: no drain in Slurm, no denylist entry; the one row not skipped is
    # the store's record that the run ended (its job ended by itself).
    drained = {n: i.reason for n, i in cluster.client.nodes().items() if i.status.drain_requested}
    assert drained == {}
    with run.database.session() as s:
        assert s.scalar(select(func.count()).select_from(DenylistEntry)) == 0
    acted = [(a.kind, a.status) for a in run.actions() if a.status is not ActionStatus.SKIPPED]
    assert acted == [(ActionKind.FINISH_RUN, ActionStatus.DONE)]
    # One row per decision, not one per control pass while nothing changes.
    leaves = run.actions(Action.kind == ActionKind.AGENT_LEAVE)
    assert [(a.node, a.status) for a in leaves] == [(victim, ActionStatus.SKIPPED)]
    assert len(cluster.client.jobs([run.job_id])) == 1
    run.database.dispose()
