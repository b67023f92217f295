"""Exact resume under torchrun (gloo, world size 3): kills, partial saves, corruption, a new
world size, and refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tiny_runs import TinyRun, copy_run, run_tiny

# One worker for the module: its runs are session fixtures (tests/integration/train/conftest.py),
# made once per worker that asks for them.
pytestmark = [pytest.mark.torch, pytest.mark.xdist_group("tiny-session-runs")]

# Sums of the same numbers in another order; the runs below are in fact bitwise equal.
LOSS_TOLERANCE = 1e-6


def assert_same_steps(run: TinyRun, baseline: TinyRun, steps: range) -> None:
    got, want = run.steps(), baseline.steps()
    for step in steps:
        assert got[step]["samples"] == want[step]["samples"], f"step {step}: other samples"
        assert got[step]["lr"] == pytest.approx(want[step]["lr"], rel=1e-12), f"step {step}: LR"
        assert math.isclose(got[step]["loss"], want[step]["loss"], rel_tol=LOSS_TOLERANCE), (
            f"step {step}: loss {got[step]['loss']} != {want[step]['loss']}"
        )


def assert_same_weights(run: TinyRun, baseline: TinyRun) -> None:
    import torch

    got, want = run.final_weights(), baseline.final_weights()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_a_killed_and_resumed_run_equals_the_uninterrupted_one(
    interrupted_run: TinyRun, baseline_run: TinyRun
) -> None:
    assert_same_steps(interrupted_run, baseline_run, range(1, 21))
    assert_same_weights(interrupted_run, baseline_run)
    evals = {e["step"]: e["loss"] for e in baseline_run.events("eval")}
    assert sorted(evals) == [4, 8, 12, 16, 20]
    assert {e["step"]: e["loss"] for e in interrupted_run.events("eval")} == evals
    # Each step's samples appear once per attempt: resumed runs redo only the lost steps.
    attempts = [(r["attempt"], r["step"]) for r in interrupted_run.records()]
    assert attempts == (
        [(0, s) for s in range(1, 11)]
        + [(1, s) for s in range(6, 14)]
        + [(2, s) for s in range(11, 21)]
    )
    resumed = interrupted_run.events("resumed")
    assert all(e["rng_restored"] for e in resumed)
    # The surviving ranks left at once through the collective-error exit.
    assert "slurmft: collective error, exiting with 75" in interrupted_run.output


def test_a_kill_in_the_middle_of_a_save_never_resumes_from_the_partial_checkpoint(
    interrupted_run: TinyRun,
) -> None:
    first_resume, second_resume = interrupted_run.events("resumed")
    assert (first_resume["attempt"], first_resume["step"]) == (1, 5)  # not the step-10 save
    removed = interrupted_run.events("removed_unpublished")
    assert [(e["attempt"], e["names"]) for e in removed] == [(1, [".staging-step-000000010"])]
    assert (second_resume["attempt"], second_resume["step"]) == (2, 10)


def test_a_corrupted_newest_checkpoint_falls_back_to_the_one_before(
    interrupted_run: TinyRun, baseline_run: TinyRun, tmp_path: Path
) -> None:
    ckpt = copy_run(interrupted_run, tmp_path)  # steps 10, 15, 20
    shard = ckpt / "step-000000020" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    run = run_tiny(tmp_path, "--steps", "20")
    assert run.returncode == 0, run.output[-4000:]
    (resumed,) = run.events("resumed")
    assert resumed["step"] == 15
    assert "step-000000020: rank 1: __1_0.distcp: checksum mismatch" in resumed["skipped"]
    assert (ckpt / "invalid-step-000000020").is_dir()  # set aside, not deleted
    assert sorted(run.steps()) == list(range(16, 21))
    assert_same_steps(run, baseline_run, range(16, 21))
    assert_same_weights(run, baseline_run)


def test_a_resume_at_another_world_size_keeps_the_global_batch_and_lr_schedule(
    baseline_run: TinyRun, tmp_path: Path
) -> None:
    copy_run(baseline_run, tmp_path, keep_steps={10})
    run = run_tiny(tmp_path, "--steps", "20", "--telemetry", "gather", nproc=2)
    assert run.returncode == 0, run.output[-4000:]
    (resumed,) = run.events("resumed")
    assert (resumed["step"], resumed["saved_world_size"], resumed["world_size"]) == (10, 3, 2)
    assert resumed["plan"] == {
        "global_batch": 12,
        "world_size": 2,
        "micro_batch": 3,
        "accumulation_steps": 2,
    }
    got, want = run.steps(), baseline_run.steps()
    assert sorted(got) == list(range(11, 21))
    for step in range(11, 21):
        # Exactly the samples the world-size-3 run used at that step, and the same LR. Losses
        # differ: dropout masks are per rank and ranks are not the same ranks any more.
        assert got[step]["samples"] == want[step]["samples"]
        assert got[step]["samples"][2] == 12
        assert got[step]["lr"] == pytest.approx(want[step]["lr"], rel=1e-12)
        assert got[step]["accumulation"] == 2


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--no-accumulation"], "the global batch would change from 12 to 8"),
        (["--lr", "0.1"], "the LR schedule would change"),
    ],
    ids=["global-batch", "lr-schedule"],
)
def test_a_resume_that_would_change_the_training_is_refused(
    baseline_run: TinyRun, tmp_path: Path, flags: list[str], expected: str
) -> None:
    copy_run(baseline_run, tmp_path, keep_steps={10})
    run = run_tiny(tmp_path, "--steps", "20", *flags, nproc=2)
    assert run.returncode != 0
    assert "refusing to resume from" in run.output
    assert expected in run.output
    assert run.records() == []  # not a single step was trained


def test_a_node_local_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    # One machine here: each rank gets its own directory, as each node would with a local path.
    run = run_tiny(tmp_path, "--steps", "5", ckpt_dir=str(tmp_path / "local-{rank}"))
    assert run.returncode != 0
    assert "is not shared by all ranks" in run.output
    assert "rank 1 on" in run.output and "rank 2 on" in run.output
    assert run.records() == []
    assert not list(tmp_path.glob("local-0/step-*"))
