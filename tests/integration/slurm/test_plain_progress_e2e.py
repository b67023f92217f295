"""Progress for a plain script: its own checkpoint files reset the crash budget.

slurmft/train/examples/plain.py (torch.distributed only, `plain-<step>.pt` written to a
temporary name and renamed) crashes every N steps under `slurmft submit` with the daemon
watching. With a checkpoint before each crash it runs to the end through more crashes than the
default cap allows in a row; without checkpoints it is stopped at the cap. The script finds its
checkpoint directory in SLURMFT_CKPT_DIR, which slurmft exports to every rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, running_daemon
from e2e_run import SubmittedRun, submit
from local_cluster import Cluster
from slurm_clusters import REPO
from support.waiting import wait_for_value

from slurmft.core.defaults import MAX_RESTARTS_WITHOUT_PROGRESS
from slurmft.db.models import Event, EventKind
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

PLAIN = str(REPO / "slurmft" / "train" / "examples" / "plain.py")
CRASH_EVERY = 20
CRASHES = MAX_RESTARTS_WITHOUT_PROGRESS + 2  # more in a row than the default cap allows


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with running_daemon(tmp_path) as process:
        yield process


def _crashing_run(
    cluster: Cluster,
    daemon: DaemonProcess,
    tmp_path: Path,
    name: str,
    args: list[str],
    *,
    timeout_s: float,
) -> SubmittedRun:
    """plain.py crashing every CRASH_EVERY steps on 2 nodes without spares, waited for until
    its run ends."""
    script = [PLAIN, "--out-dir", "{out}", "--crash-every", str(CRASH_EVERY), *args]
    run = submit(cluster, daemon, tmp_path, script, name=name, nodes=2, spares=0)
    wait_for_value(
        f"run {name} to end",
        lambda: run.run().state,
        lambda state: state.is_terminal,
        timeout_s=timeout_s,
    )
    return run


def test_a_plain_script_that_checkpoints_between_crashes_runs_to_the_end(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    # 20 steps of 0.4 s between crashes: longer than the batch step takes to see a checkpoint
    # (two polls 5 s apart), so each crash comes after the checkpoint before it was seen.
    steps = CRASH_EVERY * (CRASHES + 1)
    args = ["--steps", str(steps), "--ckpt-every", str(CRASH_EVERY), "--work-ms", "400"]
    run = _crashing_run(cluster, daemon, tmp_path, "plain-progress", args, timeout_s=480)
    assert run.run().state is RunState.COMPLETED, (run.run().end_reason, run.job_log()[-3000:])
    starts = run.jsonl("starts.jsonl")
    assert len([s for s in starts if s["rank"] == 0]) == CRASHES + 1  # every crash restarted
    assert {s["ckpt_dir_env"] for s in starts} == {str(run.ckpt_dir)}
    assert sorted({r["step"] for r in run.jsonl("steps.jsonl")}) == list(range(1, steps + 1))
    files = run.events(Event.kind == EventKind.CHECKPOINT, Event.source == "agent")
    assert {e.details["layout"] for e in files} == {"file"}, [e.details for e in files]
    assert len(files) >= CRASHES  # the batch step told the daemon of the files it found
    run.database.dispose()


def test_a_plain_script_that_crashes_without_checkpoints_stops_at_the_cap(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    args = ["--steps", "1000", "--ckpt-every", "100000", "--work-ms", "100"]
    run = _crashing_run(cluster, daemon, tmp_path, "plain-no-progress", args, timeout_s=360)
    ended = run.run()
    assert ended.state is RunState.STOPPED, (ended.end_reason, run.job_log()[-3000:])
    assert "crash loop" in (ended.end_reason or "")
    starts = [s for s in run.jsonl("starts.jsonl") if s["rank"] == 0]
    assert len(starts) <= MAX_RESTARTS_WITHOUT_PROGRESS + 2  # stopped at the cap, not later
    assert not list(run.ckpt_dir.glob("plain-*.pt"))
    run.database.dispose()
