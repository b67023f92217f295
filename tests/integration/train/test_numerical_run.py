"""Numerical faults in a real run (the example under torchrun, world size 3, gloo).

Sample 7 of the data is NaN, so each step that reads it has a non-finite loss, again on the
re-run: under `skip` that global batch is dropped and the run completes with finite losses,
naming sample 7 and the step; under `record` the run goes on (non-finite from there, reported
once); under `stop` every rank exits with 76 at that step. A NaN injected once on rank 1 is
finite on the re-run: a suspected hardware fault of rank 1's node, and training goes on."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from tiny_runs import AgentSocket, TinyRun, run_tiny

from slurmft.train.numerical import NUMERICAL_STOP_EXIT_CODE

pytestmark = pytest.mark.torch

POISONED = 7
STEPS = 40


def _run(workdir: Path, *args: str) -> tuple[TinyRun, list[dict[str, Any]]]:
    agent = AgentSocket(workdir / "agent.sock")
    try:
        run = run_tiny(workdir, "--steps", str(STEPS), "--ckpt-every", "1000", *args,
                       env={"SLURMFT_AGENT_SOCKET": str(agent.path)})  # fmt: skip
    finally:
        agent.close()
    faults = [m for _, m in agent.messages if m["kind"] == "event"]
    return run, [m for m in faults if m["event"] == "numerical_fault"]


def test_skip_drops_the_poisoned_global_batch_and_completes_with_finite_losses(
    tmp_path: Path,
) -> None:
    run, faults = _run(tmp_path, "--poison-index", str(POISONED), "--numerical-policy", "skip")
    assert run.returncode == 0, run.output[-3000:]
    (fault,) = faults
    skipped = fault["step"]
    assert (fault["reproduced"], fault["action"], fault["samples"]) == (True, "skip", [POISONED])
    records = run.records()
    assert all(math.isfinite(r["loss"]) for r in records)
    assert [r["step"] for r in records] == [s for s in range(1, STEPS + 1) if s != skipped]
    assert run.events("numerical_fault")[0]["samples"] == [POISONED]


def test_record_goes_on_and_reports_the_episode_once(tmp_path: Path) -> None:
    run, faults = _run(tmp_path, "--poison-index", str(POISONED), "--numerical-policy", "record")
    assert run.returncode == 0, run.output[-3000:]
    assert [(f["action"], f["samples"]) for f in faults] == [("record", [POISONED])]
    records = run.records()
    assert len(records) == STEPS
    first_bad = next(r["step"] for r in records if not math.isfinite(r["loss"]))
    assert first_bad == faults[0]["step"]


def test_stop_ends_every_rank_at_the_step(tmp_path: Path) -> None:
    run, faults = _run(tmp_path, "--poison-index", str(POISONED), "--numerical-policy", "stop")
    assert run.returncode != 0
    assert f"exitcode  : {NUMERICAL_STOP_EXIT_CODE}" in run.output, run.output[-3000:]
    (fault,) = faults
    assert fault["action"] == "stop"
    assert max(r["step"] for r in run.records()) == fault["step"] - 1


def test_a_nan_once_is_the_nodes_and_training_goes_on(tmp_path: Path) -> None:
    run, faults = _run(tmp_path, "--nan-once-at-step", "12", "--fault-rank", "1")
    assert run.returncode == 0, run.output[-3000:]
    (fault,) = faults
    assert (fault["rank"], fault["step"], fault["reproduced"]) == (1, 12, False)
    assert fault["action"] == "continue" and "suspected hardware fault" in fault["summary"]
    records = run.records()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
