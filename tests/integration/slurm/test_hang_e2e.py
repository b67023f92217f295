"""A hung rank on the real local Slurm cluster: one worker process of a 3+1 run is frozen with
SIGSTOP while it trains. Its heartbeats stop while its peers' still arrive (they wait for it
inside the gradient all-reduce), so the daemon declares a hang for that rank and plans a restart
of the workers on its node; the node's agent saves the workers' Python stacks (the frozen one
included: it is continued just long enough to dump them) and kills them; the stacks are the
evidence of the daemon's restart_workers action. The workers restart, resume from the last
checkpoint at world size 3, and the run completes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, running_daemon
from e2e_run import TINY, submit, worker_pid
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.agent.procs import is_alive
from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind
from slurmft.db.states import RunState

# serial: a rank silent for SILENT_AFTER_S is hung; load from other tests delays reports too.
pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.serial]

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]
# Heartbeats every second (TINY); a rank silent for 10 s while its peers report is frozen (the
# default is 30 s; below 10, two loaded cores delay reports enough for false alarms). The
# peers' step deadline (300 s) and collective timeout (30 s) are longer: the daemon, not a
# collective timeout, ends this hang.
SILENT_AFTER_S = 10


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with running_daemon(tmp_path, SLURMFT_POLICY_SILENT_AFTER_S=str(SILENT_AFTER_S)) as process:
        yield process


def test_a_frozen_rank_is_declared_hung_its_stacks_saved_and_the_run_recovers(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(cluster, daemon, tmp_path, [*EXAMPLE, *TINY], name="hang")
    run.wait_training()
    rank = 1
    node = run.beating_nodes()[rank]
    pid = worker_pid(run, rank)

    os.kill(pid, signal.SIGSTOP)
    stopped_wall = time.time()  # the run's journal stamps its events with wall time
    hangs, detected_s = wait_for_value(
        f"the daemon to declare rank {rank} hung",
        lambda: run.events(Event.kind == EventKind.HANG, Event.source == "daemon"),
        bool,
        timeout_s=60,
    )
    assert [(e.rank, e.node) for e in hangs] == [(rank, node)], [e.message for e in hangs]
    assert "silent" in hangs[0].message

    restarts, _ = wait_for_value(
        "the restart_workers action to hold the saved stacks",
        lambda: run.actions(Action.kind == ActionKind.RESTART_WORKERS),
        lambda found: any(a.event_id is not None for a in found),
        timeout_s=60,
    )
    (restart,) = restarts
    assert (restart.node, restart.status) == (node, ActionStatus.DONE)
    stacks = restart.evidence["stacks"][str(rank)]
    assert "tiny.py" in stacks and ("in train_step" in stacks or "in run" in stacks), stacks
    (agent_hang,) = run.events(Event.id == restart.event_id)
    assert (agent_hang.source, agent_hang.kind, agent_hang.node) == ("agent", EventKind.HANG, node)
    wait_for_value(
        "the frozen worker to be gone", lambda: is_alive(pid), lambda alive: not alive, 30
    )

    resumed, _ = wait_for_value(
        "the workers to resume from the last checkpoint",
        lambda: [e for e in run.jsonl("events.jsonl") if e["event"] == "resumed"],
        lambda found: any(e["time"] > stopped_wall for e in found),
        timeout_s=120,
    )
    assert resumed[-1]["step"] % 5 == 0 and resumed[-1]["world_size"] == 3
    print(
        f"\nSIGSTOP -> hang event {detected_s:.1f} s, -> resumed from step "
        f"{resumed[-1]['step']} {resumed[-1]['time'] - stopped_wall:.1f} s"
    )
    # A hang restarts the workers in place: the node stays in the run and in service.
    removals = {ActionKind.AGENT_LEAVE, ActionKind.DRAIN_NODE, ActionKind.EVICT_NODE}
    assert not [a.reason for a in run.actions() if a.kind in removals]
    final, _ = wait_for_value(
        "the run to end", run.run, lambda r: r.state.is_terminal, timeout_s=240
    )
    assert final.state is RunState.COMPLETED, final.end_reason
    records = run.jsonl("losses.jsonl")
    assert {r["world_size"] for r in records} == {3}
    assert sorted({r["step"] for r in records}) == list(range(1, 61)), run.job_log()[-2000:]
    run.database.dispose()
