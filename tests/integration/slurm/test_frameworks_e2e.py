"""A PyTorch Lightning run (slurmft/train/examples/lightning_tiny.py: a LightningModule with
SlurmftCallback and ResumableLoader) and a Hugging Face Trainer run
(slurmft/train/examples/hf_tiny.py: a Trainer with SlurmftTrainerCallback), each under
`slurmft submit` on the real local Slurm cluster, 2 nodes + 1 spare: an active node is killed
mid-epoch, the spare joins at world size 2, the framework resumes from its own checkpoint
(last.ckpt, checkpoint-N), the run completes, and every loss after the resume equals an
uninterrupted run's with the same seed, bit for bit. The framework's checkpoints are the run's
progress in the store."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import submit
from local_cluster import Cluster
from support.processes import run_dumping_stacks_on_overrun
from support.waiting import wait_for_value

from slurmft.db.models import Event, EventKind
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

FRAMEWORKS = {
    "lightning": "slurmft.train.examples.lightning_tiny",
    "hf": "slurmft.train.examples.hf_tiny",
}
STEPS = 60  # an epoch is 32 steps (512 samples, a global batch of 16)
ARGS = ["--steps", str(STEPS), "--ckpt-every", "5", "--heartbeat-interval-s", "1"]


def _uninterrupted(module: str, workdir: Path) -> dict[int, float]:
    """The same run, uninterrupted, at world size 2 on this machine (torchrun, 2 processes)."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out = workdir / "out"
    argv = [torchrun, "--standalone", "--nproc-per-node=2", "-m", module,
            "--ckpt-dir", str(workdir / "ckpt"), "--out-dir", str(out), *ARGS]  # fmt: skip
    env = {"PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = run_dumping_stacks_on_overrun(argv, timeout_s=240, stacks_dir=workdir / "stacks",
                                         env=env, cwd=workdir.parent)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    records = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_framework_run_survives_a_node_kill_and_resumes_bit_for_bit(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path, framework: str
) -> None:
    module = FRAMEWORKS[framework]
    run = submit(
        cluster,
        daemon,
        tmp_path,
        ["-m", module, "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", *ARGS, "--work-ms", "150"],
        name=framework,
        nodes=2,
        spares=1,
        env={"HF_HUB_OFFLINE": "1"},
    )
    wait_for_value(
        f"{framework} training past step 12 on two nodes",
        lambda: (run.beating_nodes(), run.latest_step()),
        lambda seen: len(set(seen[0].values())) == 2 and seen[1] >= 12,
        timeout_s=180,
    )
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
    killed_at = run.latest_step()
    assert killed_at < 32, "the kill must land mid-epoch"
    cluster.kill_node(victim)
    wait_for_value(
        "the daemon to record the loss",
        lambda: run.events(Event.kind == EventKind.NODE_LOST, Event.node == victim),
        lambda found: len(found) == 1,
        timeout_s=60,
    )
    final, _ = wait_for_value("the run to end", run.run, lambda r: r.state.is_terminal, 300)
    assert final.state is RunState.COMPLETED, run.job_log()[-4000:]

    records = run.jsonl("losses.jsonl")
    steps = [r["step"] for r in records]
    resumed_from = next(b - 1 for a, b in itertools.pairwise(steps) if b <= a)
    assert resumed_from % 5 == 0 and killed_at - 5 <= resumed_from <= killed_at + 5, steps
    assert "slurmft: training from step" in run.job_log()
    assert {r["world_size"] for r in records} == {2}
    expected = _uninterrupted(module, tmp_path / "reference")
    assert len(expected) == STEPS
    # The last record of each step: after the resume, the replayed and the new steps.
    assert {r["step"]: r["loss"] for r in records} == expected

    # The framework's checkpoints are the run's progress: reported, verified steps, in the store.
    saved = run.events(Event.kind == EventKind.CHECKPOINT, Event.source == "agent")
    # (The batch step's sightings of the files on disk are there too, by label, not step.)
    saved_steps = {e.details["step"] for e in saved if isinstance(e.details.get("step"), int)}
    every = set(range(5, STEPS + 1, 5))
    # Those saved before the kill may be lost with the node when rank 0 was on it: its agent
    # posts once a second, and a report made just before the kill dies unsent.
    assert {step for step in every if step > resumed_from} <= saved_steps <= every, saved_steps
    run.database.dispose()
