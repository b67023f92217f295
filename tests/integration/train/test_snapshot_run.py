"""In-memory snapshots (slurmft.train.snapshot) in the example under torchrun, world size 3: a rank
killed at step 17 with durable checkpoints only every 10 steps resumes from the snapshot of step
16 (one step replayed, not seven) and every loss equals an uninterrupted run's; with the
snapshots corrupted it falls back to the durable checkpoint of step 10, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_runs import TinyRun, run_tiny

pytestmark = pytest.mark.torch

ARGS = ["--steps", "24", "--ckpt-every", "10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    run = run_tiny(tmp_path_factory.mktemp("uninterrupted"), *ARGS)
    assert run.returncode == 0, run.output
    return run


def interrupted(workdir: Path, *extra: str) -> TinyRun:
    run = run_tiny(
        workdir,
        *ARGS,
        "--snapshots",
        "--snapshot-dir",
        str(workdir / "shm"),
        "--snapshot-every",  # the tiny model's steps take milliseconds: K from cost is larger
        "1",
        "--crash-at-step",
        "17",
        *extra,
        max_restarts=1,
    )
    assert run.returncode == 0, run.output
    return run


def assert_same_losses(run: TinyRun, uninterrupted: TinyRun) -> None:
    expected = {step: (r["loss"], r["lr"]) for step, r in uninterrupted.steps().items()}
    assert {step: (r["loss"], r["lr"]) for step, r in run.steps().items()} == expected


def test_a_restart_resumes_from_the_newest_snapshot_and_trains_exactly_as_without_one(
    tmp_path: Path, uninterrupted: TinyRun
) -> None:
    run = interrupted(tmp_path)
    (resumed,) = run.events("resumed")
    assert (resumed["source"], resumed["step"]) == ("snapshot", 16)
    steps = [r["step"] for r in run.records()]
    assert steps.count(17) == 2 and all(steps.count(s) == 1 for s in set(steps) - {17})
    assert_same_losses(run, uninterrupted)
    # Progress stays the durable checkpoints': a snapshot is never published as one.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        "step-000000010", "step-000000020", "step-000000024",
    ]  # fmt: skip


def test_corrupt_snapshots_fall_back_to_the_durable_checkpoint_with_the_reason(
    tmp_path: Path, uninterrupted: TinyRun
) -> None:
    run = interrupted(tmp_path, "--corrupt-snapshots-at-crash")
    (not_used,) = [e for e in run.events("snapshot_not_used") if e["durable_step"] == 10]
    assert "checksum mismatch" in not_used["reason"]
    (resumed,) = run.events("resumed")
    assert resumed["step"] == 10 and "source" not in resumed
    assert_same_losses(run, uninterrupted)
