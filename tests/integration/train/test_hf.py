"""A Hugging Face Trainer under slurmft (slurmft.train.hf), at world size 2 on gloo, offline.

A run whose rank 1 is SIGKILLed at step 17 and restarted by torchrun resumes from the Trainer's
checkpoint-15, and its losses equal the uninterrupted run's bit for bit; every checkpoint the
Trainer writes is reported as progress once synced, with the contract beside it; heartbeats
carry phases, and steps their timing; a save request on one rank makes every rank save at one
step; a changed global batch is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tiny_runs import (
    AgentSocket,
    TinyRun,
    assert_phases_and_step_timings,
    run_module,
    run_with_save_request,
)

from slurmft.train.hf import CONTRACT_FILE

pytestmark = pytest.mark.torch

MODULE = "slurmft.train.examples.hf_tiny"
STEPS = 30


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyRun, list[dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("hf-whole")
    agent = AgentSocket(workdir / "agent.sock")
    try:
        run = run_module(MODULE, workdir, "--steps", str(STEPS), "--heartbeat-interval-s", "0.2",
                         agent=agent)  # fmt: skip
    finally:
        agent.close()
    assert run.returncode == 0, run.output[-4000:]
    return run, [m for _, m in agent.messages]


def test_losses_after_a_restart_equal_the_uninterrupted_runs_bit_for_bit(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]], tmp_path: Path
) -> None:
    whole, _ = uninterrupted
    restarted = run_module(MODULE, tmp_path, "--steps", str(STEPS), "--crash-at-step", "17",
                           max_restarts=1)  # fmt: skip
    assert restarted.returncode == 0, restarted.output[-4000:]
    assert "slurmft: training from step 15 at world size 2" in restarted.output
    steps = [r["step"] for r in restarted.records()]
    assert steps[-STEPS + 15 :] == list(range(16, STEPS + 1)) and steps.count(16) == 2, steps
    expected = {step: r["loss"] for step, r in whole.steps().items()}
    assert len(expected) == STEPS
    assert {step: r["loss"] for step, r in restarted.steps().items()} == expected
    assert {step: r["lr"] for step, r in restarted.steps().items()} == {
        step: r["lr"] for step, r in whole.steps().items()
    }


def test_every_checkpoint_the_trainer_writes_is_reported_with_its_contract(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]],
) -> None:
    run, messages = uninterrupted
    saved = [m for m in messages if m["kind"] == "event" and m["event"] == "checkpoint_saved"]
    assert {m["rank"] for m in saved} == {0}
    assert [m["step"] for m in saved] == list(range(5, STEPS + 1, 5))
    for message in saved:
        folder = Path(message["path"])
        assert folder == run.ckpt_dir / f"checkpoint-{message['step']}"
        contract = json.loads((folder / CONTRACT_FILE).read_text())
        assert contract["global_batch"] == 16  # 8 per rank x 2 ranks
        assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= {
            p.name for p in folder.iterdir()
        }


def test_heartbeats_carry_phases_and_steps_their_timing(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]],
) -> None:
    assert_phases_and_step_timings(uninterrupted[1], STEPS)


def test_a_save_request_makes_every_rank_save_at_one_step(tmp_path: Path) -> None:
    run, requested_after = run_with_save_request(
        MODULE, tmp_path, "--steps", "40", "--ckpt-every", "1000", "--work-ms", "100"
    )
    assert run.returncode == 0, run.output[-4000:]
    # The Trainer saves at max_steps too; the requested save is the one before it.
    steps = sorted(int(p.name.removeprefix("checkpoint-")) for p in (tmp_path / "ckpt").iterdir())
    assert len(steps) == 2 and steps[1] == 40, steps
    assert requested_after < steps[0] <= requested_after + 3
    folder = tmp_path / "ckpt" / f"checkpoint-{steps[0]}"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in folder.iterdir()}


def test_a_changed_global_batch_is_refused(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]], tmp_path: Path
) -> None:
    whole, _ = uninterrupted
    shutil.copytree(whole.ckpt_dir, tmp_path / "ckpt")
    run = run_module(MODULE, tmp_path, "--steps", str(STEPS + 5), "--batch-size", "4")
    assert run.returncode != 0
    assert "the global batch would change from 16 to 8" in run.output, run.output[-3000:]
