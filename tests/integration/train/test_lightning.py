"""PyTorch Lightning under slurmft (slurmft.train.lightning), at world size 2 on gloo.

A run whose rank 1 is SIGKILLed at step 17 and restarted by torchrun resumes from Lightning's
last.ckpt, and its losses equal the uninterrupted run's bit for bit; every checkpoint Lightning
writes is reported as progress once it is on disk; heartbeats carry phases, and steps their
timing; a save request on one rank makes every rank save at one step; a changed global batch
is refused; Lightning's own Slurm requeue and a loader that cannot resume are refused."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments.slurm import SLURMEnvironment
from tiny_runs import (
    AgentSocket,
    TinyRun,
    assert_phases_and_step_timings,
    run_module,
    run_with_save_request,
)
from torch.utils.data import DataLoader, TensorDataset

from slurmft.train.examples.framework_runs import parse_args
from slurmft.train.examples.lightning_tiny import TinyModule
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
    assert_phases_and_step_timings(uninterrupted[1], STEPS)


def test_a_save_request_makes_every_rank_save_at_one_step(tmp_path: Path) -> None:
    run, requested_after = run_with_save_request(
        MODULE, tmp_path, "--steps", "40", "--ckpt-every", "1000", "--work-ms", "100"
    )
    assert run.returncode == 0, run.output[-4000:]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    # One save, at the step boundary after the request, with both ranks' state in it. The
    # example writes a step's loss in its forward, before the ranks exchange their requests
    # after it (`on_before_backward`): a request made on seeing step N's loss may be agreed in
    # step N itself, and saved at its end (seen once in a loaded run of the suite).
    assert requested_after <= saved["global_step"] <= requested_after + 3
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


def _args(tmp_path: Path) -> argparse.Namespace:
    (tmp_path / "out").mkdir(exist_ok=True)
    return parse_args("lightning_tiny", ["--ckpt-dir", str(tmp_path / "ck"),
                                         "--out-dir", str(tmp_path / "out")])  # fmt: skip


def _fit_one_process(
    tmp_path: Path, ckpt_path: Path | None = None, max_steps: int = 2, **trainer_options: Any
) -> pl.Trainer:
    args = _args(tmp_path)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False,
                         use_distributed_sampler=False, **trainer_options)  # fmt: skip
    trainer.fit(TinyModule(args), ckpt_path=ckpt_path)
    return trainer


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

    args = _args(tmp_path)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False,
                         callbacks=[SlurmftCallback()])  # fmt: skip
    with pytest.raises(LightningConflict, match=r"no slurmft\.train\.lightning\.ResumableLoader"):
        trainer.fit(PlainLoaderModule(args))


def test_a_checkpoint_written_without_the_callback_is_refused(tmp_path: Path) -> None:
    """Its sample position and RNG are unknown: resuming from it would not be exact."""
    _fit_one_process(tmp_path).save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(LightningConflict, match="written without SlurmftCallback"):
        _fit_one_process(tmp_path, tmp_path / "plain.ckpt", 4, callbacks=[SlurmftCallback()])
