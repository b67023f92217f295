"""A Hugging Face Trainer under slurmft (slurmft.train.hf), at world size 2 on gloo, offline.

A run whose rank 1 is SIGKILLed at step 17 and restarted by torchrun resumes from the Trainer's
checkpoint-15, and its losses equal the uninterrupted run's bit for bit; every checkpoint the
Trainer writes is reported as progress once synced, with the contract beside it; heartbeats
carry phases, and steps their timing; a save request on one rank makes every rank save at one
step; a changed global batch is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_telemetry_run import wait_for_step
from tiny_runs import (
    RUN_TIMEOUT_S,
    AgentSocket,
    TinyRun,
    run_module,
    torchrun_command,
    torchrun_env,
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
    _, messages = uninterrupted
    beats = [m for m in messages if m["kind"] == "heartbeat"]
    assert {m["rank"] for m in beats} == {0, 1}
    assert {"init", "step", "done"} <= {m["phase"] for m in beats}
    steps = [m for m in messages if m["kind"] == "step"]
    for rank in (0, 1):
        mine = [m for m in steps if m["rank"] == rank]
        assert [m["step"] for m in mine] == list(range(1, STEPS + 1))
        for m in mine:
            assert m["compute_s"] > 0 and m["wait_s"] >= 0
            assert m["total_s"] >= m["compute_s"] + m["wait_s"]


def test_a_save_request_makes_every_rank_save_at_one_step(tmp_path: Path) -> None:
    request_file = tmp_path / "save-request"
    args = [
        "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out"),
        "--steps", "40", "--ckpt-every", "1000", "--work-ms", "100",
    ]  # fmt: skip
    env = torchrun_env(tmp_path, {"SLURMFT_SAVE_REQUEST_FILE": str(request_file)})
    process = subprocess.Popen(
        torchrun_command(2, 0, args, module=MODULE), cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        losses = tmp_path / "out" / "losses.jsonl"
        wait_for_step(losses, 10, process)
        requested_after = max(json.loads(x)["step"] for x in losses.read_text().splitlines())
        request_file.touch()  # what the agent does on Slurm's time-limit signal
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-4000:]
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
