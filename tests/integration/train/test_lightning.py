"""PyTorch Lightning under slurmft (slurmft.train.lightning), at world size 2 on gloo.

A run whose rank 1 is SIGKILLed at step 17 and restarted by torchrun resumes from Lightning's
last.ckpt, and its losses equal the uninterrupted run's bit for bit; every checkpoint Lightning
writes is reported as progress once it is on disk; heartbeats carry phases, and steps their
timing; a save request on one rank makes every rank save at one step; a changed global batch
is refused; Lightning's own Slurm requeue and a loader that cannot resume are refused."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments.slurm import SLURMEnvironment
from test_telemetry_run import wait_for_step
from tiny_runs import (
    RUN_TIMEOUT_S,
    AgentSocket,
    TinyRun,
    run_module,
    torchrun_command,
    torchrun_env,
)
from torch.utils.data import DataLoader, TensorDataset

from slurmft.train.examples.lightning_tiny import TinyModule, parse_args
from slurmft.train.lightning import STATE_KEY, LightningConflict, SlurmftCallback

pytestmark = pytest.mark.torch

MODULE = "slurmft.train.examples.lightning_tiny"
STEPS = 30


def run_lightning(workdir: Path, *args: str, **options: Any) -> TinyRun:
    return run_module(MODULE, workdir, *args, **options)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyRun, list[dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("lightning-whole")
    agent = AgentSocket(workdir / "agent.sock")
    try:
        run = run_lightning(workdir, "--steps", str(STEPS), "--heartbeat-interval-s", "0.2",
                            agent=agent)  # fmt: skip
    finally:
        agent.close()
    assert run.returncode == 0, run.output[-4000:]
    return run, [m for _, m in agent.messages]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    run = run_lightning(
        tmp_path_factory.mktemp("lightning-restarted"),
        "--steps", str(STEPS), "--crash-at-step", "17", "--fault-rank", "1",
        max_restarts=1,
    )  # fmt: skip
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_losses_after_a_restart_equal_the_uninterrupted_runs_bit_for_bit(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]], restarted: TinyRun
) -> None:
    whole, _ = uninterrupted
    order = [r["step"] for r in restarted.records()]
    # Killed in step 17, resumed from the step-15 checkpoint: 16 and 17 again.
    assert order == [*range(1, 18), *range(16, STEPS + 1)], order
    assert "slurmft: training from step 15 at world size 2" in restarted.output
    expected = {step: r["loss"] for step, r in whole.steps().items()}
    assert {step: r["loss"] for step, r in restarted.steps().items()} == expected
    assert len(expected) == STEPS and all(r["world_size"] == 2 for r in restarted.records())
    # The LR schedule went on where it was (StepLR halves every 10 steps).
    assert [restarted.steps()[s]["lr"] for s in (10, 11, 21, 30)] == [0.01, 0.005, 0.0025, 0.0025]


def test_every_checkpoint_lightning_writes_is_reported_once_on_disk(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]],
) -> None:
    run, messages = uninterrupted
    saved = [m for m in messages if m["kind"] == "event" and m["event"] == "checkpoint_saved"]
    assert {m["rank"] for m in saved} == {0}  # rank 0 writes; one report per file
    steps = sorted({m["step"] for m in saved})
    assert steps == list(range(5, STEPS + 1, 5))
    for message in saved:
        assert Path(message["path"]).parent == run.ckpt_dir
    last = torch.load(run.ckpt_dir / "last.ckpt", weights_only=False)
    assert last["global_step"] == STEPS and len(last[STATE_KEY]["rng"]) == 2
    assert last[STATE_KEY]["contract"]["global_batch"] == 16  # 8 per rank x 2 ranks


def test_heartbeats_carry_phases_and_steps_their_timing(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]],
) -> None:
    _, messages = uninterrupted
    beats = [m for m in messages if m["kind"] == "heartbeat"]
    assert {m["rank"] for m in beats} == {0, 1}
    phases = {m["phase"] for m in beats}
    assert {"init", "step", "done"} <= phases, phases
    assert beats[-1]["phase"] == "done" or any(m["phase"] == "done" for m in beats[-4:])
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
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    # One save, at the step boundary after the request, with both ranks' state in it.
    assert requested_after < saved["global_step"] <= requested_after + 3
    assert len(saved[STATE_KEY]["rng"]) == 2
    # Lightning's own checkpoint wrote only at the end of training (every 1,000 steps), beside
    # it: ModelCheckpoint names its `last` last-v1.ckpt, and `ckpt_path="last"` takes the newest.
    others = [p for p in (tmp_path / "ckpt").iterdir() if p.name != "last.ckpt"]
    assert [torch.load(p, weights_only=False)["global_step"] for p in others] == [40]


def test_a_changed_global_batch_is_refused(
    uninterrupted: tuple[TinyRun, list[dict[str, Any]]], tmp_path: Path
) -> None:
    whole, _ = uninterrupted
    shutil.copytree(whole.ckpt_dir, tmp_path / "ckpt")
    run = run_lightning(tmp_path, "--steps", str(STEPS + 5), "--batch-size", "4")
    assert run.returncode != 0
    assert "the global batch would change from 16 to 8" in run.output, run.output[-3000:]


def _fit_one_process(tmp_path: Path, **trainer_options: Any) -> None:
    args = parse_args(["--ckpt-dir", str(tmp_path / "ck"), "--out-dir", str(tmp_path / "out")])
    (tmp_path / "out").mkdir()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False,
                         use_distributed_sampler=False, **trainer_options)  # fmt: skip
    trainer.fit(TinyModule(args))


def test_lightnings_own_requeue_on_the_save_signal_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LightningConflict, match=r"auto_requeue=True\) would requeue the job"):
        _fit_one_process(
            tmp_path, plugins=[SLURMEnvironment(auto_requeue=True)], callbacks=[SlurmftCallback()]
        )


def test_a_loader_that_cannot_resume_exactly_is_refused(tmp_path: Path) -> None:
    class PlainLoaderModule(TinyModule):
        def train_dataloader(self) -> Any:
            data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
            return DataLoader(data, batch_size=8)

    args = parse_args(["--ckpt-dir", str(tmp_path / "ck"), "--out-dir", str(tmp_path / "out")])
    (tmp_path / "out").mkdir()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False,
                         callbacks=[SlurmftCallback()])  # fmt: skip
    with pytest.raises(LightningConflict, match=r"no slurmft\.train\.lightning\.ResumableLoader"):
        trainer.fit(PlainLoaderModule(args))
