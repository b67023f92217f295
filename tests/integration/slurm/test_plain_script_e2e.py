"""A plain torchrun script (slurmft/train/examples/plain.py: torch.distributed only, its own
checkpoint files, never importing slurmft) under `slurmft submit` on the real local Slurm
cluster: an active node is killed, the spare joins at the same world size, the script resumes
from its own checkpoint and the run completes. It sends no heartbeats, and its silence is
never taken for a hang or a silent channel, even with the silence threshold at 5 s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_process import DaemonProcess, running_daemon
from e2e_run import submit
from local_cluster import Cluster
from slurm_clusters import REPO
from support.waiting import wait_for_value

from slurmft.db.models import Action, ActionKind, Event, EventKind
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

PLAIN = str(REPO / "slurmft" / "train" / "examples" / "plain.py")
STEPS = 60
PACE = ["--ckpt-every", "5", "--work-ms", "150", "--pg-timeout-s", "30"]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    # A short silence threshold: were silence read as a hang, it would show within the run.
    with running_daemon(tmp_path, SLURMFT_POLICY_SILENT_AFTER_S="5") as process:
        yield process


def _latest_group(starts: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The newest start line of each rank."""
    return {s["rank"]: s for s in starts}


def test_plain_torchrun_script_survives_a_node_kill_and_is_never_taken_for_hung(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(
        cluster,
        daemon,
        tmp_path,
        [PLAIN, "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", "--steps", str(STEPS), *PACE],
        name="plain",
    )
    wait_for_value(
        "the plain script training past a checkpoint on three nodes",
        lambda: (run.jsonl("steps.jsonl"), _latest_group(run.jsonl("starts.jsonl"))),
        lambda seen: any(r["step"] >= 10 for r in seen[0]) and len(seen[1]) == 3,
        timeout_s=180,
    )
    group = _latest_group(run.jsonl("starts.jsonl"))
    assert {s["world_size"] for s in group.values()} == {3}
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted({s["node"] for s in group.values()} - {batch_host})[0]
    cluster.kill_node(victim)

    wait_for_value(
        "the daemon to record the loss",
        lambda: run.events(Event.kind == EventKind.NODE_LOST, Event.node == victim),
        lambda found: len(found) == 1,
        timeout_s=60,
    )
    starts, _ = wait_for_value(
        "the spare to join: three ranks again, none on the dead node",
        lambda: run.jsonl("starts.jsonl"),
        lambda found: (
            len(found) >= 6
            and victim not in {s["node"] for s in _latest_group(found).values()}
            and len({s["node"] for s in _latest_group(found).values()}) == 3
        ),
        timeout_s=120,
    )
    resumed = _latest_group(starts)
    assert {s["world_size"] for s in resumed.values()} == {3}
    assert min(s["step"] for s in resumed.values()) >= 5  # from its own checkpoint

    wait_for_value(
        "the run to complete",
        lambda: run.run().state,
        lambda state: state is RunState.COMPLETED,
        timeout_s=240,
    )
    steps = run.jsonl("steps.jsonl")
    assert {r["world_size"] for r in steps} == {3}
    assert sorted({r["step"] for r in steps}) == list(range(1, STEPS + 1)), run.job_log()[-2000:]
    assert all(s["slurmft"] == [] for s in run.jsonl("starts.jsonl"))  # never imported

    # No heartbeats, and their absence is not a finding: no hang, no silent channel, no restart.
    assert run.beating_nodes() == {}
    silence = run.events(Event.kind.in_([EventKind.HANG, EventKind.CHANNEL_SILENT]))
    assert silence == [], [e.message for e in silence]
    assert run.actions(Action.kind == ActionKind.RESTART_WORKERS) == []
    assert len(cluster.client.jobs([run.job_id])) == 1
    run.database.dispose()
