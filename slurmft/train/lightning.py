"""PyTorch Lightning under slurmft: one callback and one data loader, nothing else to rewrite.

    from slurmft.train.lightning import ResumableLoader, SlurmftCallback

    class Model(pl.LightningModule):
        def train_dataloader(self):
            return ResumableLoader(dataset, batch_size=32, seed=0)

    trainer = pl.Trainer(
        strategy="ddp",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        use_distributed_sampler=False,          # ResumableLoader shards by rank itself
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=50, save_last=True),
                   SlurmftCallback(lr_schedule={"kind": "cosine", "lr": 3e-4})],
    )
    trainer.fit(Model(), ckpt_path="last")      # resumes from the newest last.ckpt, if any

What the callback adds (docs/train.md, "PyTorch Lightning"):
- phase heartbeats (init, step, checkpoint, eval) and per-step timing: compute is the forward
  pass, which no collective touches (under DDP the backward overlaps the gradient all-reduce, so
  it cannot be split), wait is one small all-gather of every rank's compute time after it;
- stragglers named from those times, as the hand-written loop does;
- progress: every checkpoint Lightning writes is reported once it is on disk;
- the coordinated save: Slurm's time-limit signal (SIGUSR1, or the agent's request file) on any
  rank makes every rank save at the same step boundary;
- exact resume: Lightning's checkpoint (weights, optimizer, schedulers, loop counters), plus the
  loader's position in the sample order and every rank's RNG; the global batch and the LR
  schedule are checked unchanged;
- a collective error (a peer died) ends the process with exit code 75, for the agent.

Lightning's own Slurm handling stays out of the way: under torchrun Lightning picks its
TorchElastic environment, which installs no requeue handler, so slurmft's SIGUSR1 is the only
one. A Trainer given `SLURMEnvironment(auto_requeue=True)` is refused at setup: Lightning would
requeue the job behind the daemon's back on the signal slurmft uses for its coordinated save.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments.slurm import SLURMEnvironment
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import CheckpointIO
from torch.utils.data import DataLoader, Dataset

from slurmft.errors import SlurmftError
from slurmft.train.distributed import (
    COLLECTIVE_ERROR_EXIT_CODE,
    exit_without_teardown,
    is_collective_error,
)
from slurmft.train.heartbeat import Heartbeat, Phase
from slurmft.train.report import ReportChannel
from slurmft.train.resume import TrainingContract, check_resume
from slurmft.train.rng import capture_rng_state, restore_rng_state
from slurmft.train.sampler import ResumableSampler
from slurmft.train.save_request import SaveRequest
from slurmft.train.stacks import install_stack_dump
from slurmft.train.straggler import PeerGroups, StragglerDetector, StragglerNotices
from slurmft.train.timing import StepTimer, exchange_telemetry

STATE_KEY = "slurmft"  # the callback's part of a Lightning checkpoint
REQUESTED_SAVE = "last.ckpt"  # what the coordinated save writes, where `ckpt_path="last"` looks


class LightningConflict(SlurmftError):
    """The Trainer is set up in a way that fights slurmft (the message says which and the fix)."""


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader over `ResumableSampler`: this rank's share of one global sample order, whose
    position Lightning saves in its checkpoint and restores before it iterates (Lightning treats
    a loader with `state_dict` / `load_state_dict` as resumable)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        **loader_options: Any,
    ) -> None:
        self.position = ResumableSampler(len(dataset), batch_size, seed=seed, shuffle=shuffle)  # type: ignore[arg-type]
        # A generator of its own: a DataLoader draws its workers' base seed from this generator
        # each time it starts iterating, and from torch's global one without it. A resumed run
        # starts iterating at another moment than the uninterrupted one, and that one draw would
        # shift every dropout mask after it.
        loader_options.setdefault("generator", torch.Generator().manual_seed(seed))
        super().__init__(dataset, batch_size=batch_size, sampler=self.position, **loader_options)

    def state_dict(self) -> dict[str, Any]:
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position.load_state_dict(state)


class _ReportingCheckpointIO(CheckpointIO):
    """Lightning's checkpoint writer, and after each write (once the file is on disk) the
    progress report slurmft counts. Lightning writes on global rank 0 only."""

    def __init__(self, inner: CheckpointIO, channel: ReportChannel) -> None:
        self.inner = inner
        self.channel = channel

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)
        _sync_to_disk(Path(path))
        self.channel.send(
            "event", event="checkpoint_saved", step=int(checkpoint["global_step"]), path=str(path)
        )

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: Any = None
    ) -> Any:
        return self.inner.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _sync_to_disk(path: Path) -> None:
    """The file and its directory entry durable before anyone is told it exists."""
    if not path.is_file():  # a sharded strategy's folder: its writer synced its own files
        return
    with path.open("rb") as written:
        os.fsync(written.fileno())
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class SlurmftCallback(pl.Callback):
    """Heartbeats, step timing, stragglers, progress, the coordinated save and exact resume
    for a Lightning Trainer (see the module's docs).

    ``lr_schedule``: a JSON-able description of the learning-rate schedule that must not change
    across restarts (default: each scheduler's class, interval, frequency and base LRs).
    ``deadlines_s``: seconds without progress before a phase counts as stuck (the agent's
    defaults otherwise: step 300 s, checkpoint 1800 s, ...).
    """

    def __init__(
        self,
        *,
        lr_schedule: Mapping[str, Any] | None = None,
        heartbeat_interval_s: float = 5.0,
        deadlines_s: Mapping[Phase, float] | None = None,
        straggler_window: int = 10,
        allow_global_batch_change: bool = False,
        allow_lr_schedule_change: bool = False,
    ) -> None:
        self.lr_schedule = None if lr_schedule is None else dict(lr_schedule)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.deadlines_s = dict(deadlines_s or {})
        self.straggler_window = straggler_window
        self.allow_global_batch_change = allow_global_batch_change
        self.allow_lr_schedule_change = allow_lr_schedule_change
        self.channel: ReportChannel | None = None
        self.heartbeat: Heartbeat | None = None
        self.timer: StepTimer | None = None
        self.save_request: SaveRequest | None = None
        self.stragglers: StragglerNotices | None = None
        self._saved: dict[str, Any] | None = None  # the resumed checkpoint's part, until checked
        self._schedule: dict[str, Any] = {}  # this run's, read at fit start (before a restore)
        self._section: AbstractContextManager[None] | None = None
        self._save_agreed = False
        self.compute_times: list[float] | None = None  # every rank's, from the last exchange

    # -- set-up and tear-down ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_lightning_requeue(trainer)
        rank = trainer.global_rank
        install_stack_dump(rank)
        self.channel = ReportChannel()
        self.heartbeat = Heartbeat(self.channel, self.heartbeat_interval_s, self.deadlines_s)
        self.heartbeat.enter(Phase.INIT)
        self.heartbeat.start()
        self.timer = StepTimer(pl_module.device, self.heartbeat)
        self.save_request = SaveRequest()
        detector = StragglerDetector(PeerGroups.uniform(trainer.world_size), self.straggler_window)
        self.stragglers = StragglerNotices(self.channel, detector, speaks=rank == 0)
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, _ReportingCheckpointIO):
            strategy.checkpoint_io = _ReportingCheckpointIO(strategy.checkpoint_io, self.channel)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.heartbeat is None:
            return
        self.heartbeat.enter(Phase.DONE, trainer.global_step)
        self.heartbeat.stop()
        self.heartbeat = None

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """A peer died or timed out: exit 75 at once (torchrun and the agent restart the
        workers); Lightning's own clean-up would wait on the broken group."""
        if not is_collective_error(exception):
            return
        if self.channel is not None:
            self.channel.send("event", event="collective_error", error=str(exception)[:500])
        print(f"slurmft: collective error, exiting with {COLLECTIVE_ERROR_EXIT_CODE}")
        exit_without_teardown(COLLECTIVE_ERROR_EXIT_CODE)

    # -- resume --------------------------------------------------------------------------------
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Every rank takes part (Lightning builds the checkpoint on every rank; rank 0
        writes it): the contract and every rank's RNG go into it."""
        if self.heartbeat is not None:
            self.heartbeat.enter(Phase.CHECKPOINT, trainer.global_step)
        rng = capture_rng_state()
        if trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, rng)
        else:
            gathered = [rng]
        checkpoint[STATE_KEY] = {
            "contract": self._contract(trainer).to_json(),
            "rng": gathered,
            "world_size": trainer.world_size,
        }

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = checkpoint.get(STATE_KEY)
        if saved is None:
            raise LightningConflict(
                "this checkpoint was written without SlurmftCallback: its sample position and "
                "RNG are unknown, so resuming from it would not be exact; start from a "
                "checkpoint written with the callback, or without one"
            )
        self._saved = saved
        states = saved["rng"]
        rank = trainer.global_rank
        # Another world size: a rank without a state of its own takes rank 0's (the sample
        # order, kept by the loader, does not depend on the world size).
        restore_rng_state(states[rank] if rank < len(states) else states[0])

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning calls this after it built the optimizers and before it loads their state
        from a checkpoint: the schedule read here is this run's code's, not the checkpoint's."""
        self._schedule = self.lr_schedule if self.lr_schedule is not None else _schedule_of(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        contract = self._contract(trainer)  # refuses a loader that cannot resume exactly
        if self._saved is not None:
            check_resume(
                self._saved["contract"],
                contract,
                checkpoint=str(trainer.ckpt_path),
                allow_global_batch_change=self.allow_global_batch_change,
                allow_lr_schedule_change=self.allow_lr_schedule_change,
            )
            self._saved = None
        if self.heartbeat is not None:
            self.heartbeat.enter(Phase.STEP, trainer.global_step)
        if trainer.global_rank == 0:
            print(f"slurmft: training from step {trainer.global_step} at world size "
                  f"{trainer.world_size}", flush=True)  # fmt: skip

    def _contract(self, trainer: pl.Trainer) -> TrainingContract:
        loaders = _resumable_loaders(trainer)
        if not loaders:
            raise LightningConflict(
                "the train dataloader is no slurmft.train.lightning.ResumableLoader: a restart "
                "could not resume at the exact sample (use ResumableLoader, and "
                "Trainer(use_distributed_sampler=False))"
            )
        micro = sum(loader.position.batch_size for loader in loaders)
        global_batch = micro * trainer.world_size * trainer.accumulate_grad_batches
        return TrainingContract(global_batch, self._schedule)

    # -- the step ------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.timer is not None and self.heartbeat is not None
        if self.heartbeat.current_phase is not Phase.STEP:
            self.heartbeat.enter(Phase.STEP, trainer.global_step)
        if _first_micro_batch(trainer, batch_idx):
            self.timer.start_step(trainer.global_step + 1)
        self._enter(self.timer.compute())

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """The forward is done: every rank's compute time and save request in one small
        all-gather (its time is this rank's wait for the slowest)."""
        assert self.timer is not None and self.save_request is not None
        self._leave()
        pending = self.save_request.pending()
        if trainer.world_size > 1:
            with self.timer.wait():
                exchange = exchange_telemetry(
                    self.timer.current_compute_s(), pending, device=pl_module.device
                )
            self.compute_times = exchange.compute_s
            self._save_agreed |= exchange.save_requested
        else:
            self.compute_times = [self.timer.current_compute_s()]
            self._save_agreed |= pending

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        assert self.timer is not None and self.heartbeat is not None and self.channel is not None
        self._leave()
        for loader in _resumable_loaders(trainer):
            loader.position.advance()
        if not _last_micro_batch(trainer, batch_idx):
            return
        timing = self.timer.end_step()
        self.heartbeat.progress(trainer.global_step)
        if timing is not None:
            self.channel.send("step", step=trainer.global_step, compute_s=timing.compute_s,
                              wait_s=timing.wait_s, total_s=timing.total_s)  # fmt: skip
        if self.stragglers is not None and self.compute_times is not None:
            self.stragglers.observe(trainer.global_step, self.compute_times)
        if self._save_agreed:
            self._coordinated_save(trainer)

    def _coordinated_save(self, trainer: pl.Trainer) -> None:
        """Every rank saw the agreement in the same exchange, so every rank saves here."""
        assert self.save_request is not None and self.heartbeat is not None
        folder = _checkpoint_folder(trainer)
        with self.heartbeat.phase(Phase.CHECKPOINT, trainer.global_step):
            trainer.save_checkpoint(folder / REQUESTED_SAVE)
        self.save_request.clear()
        self._save_agreed = False
        self.heartbeat.enter(Phase.STEP, trainer.global_step)

    # -- evaluation ----------------------------------------------------------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.heartbeat is not None and trainer.state.fn == "fit":
            self.heartbeat.enter(Phase.EVAL, trainer.global_step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.heartbeat is not None and trainer.state.fn == "fit":
            self.heartbeat.enter(Phase.STEP, trainer.global_step)

    # -- helpers -------------------------------------------------------------------------------
    def _enter(self, section: AbstractContextManager[None]) -> None:
        self._leave()
        section.__enter__()
        self._section = section

    def _leave(self) -> None:
        if self._section is not None:
            section, self._section = self._section, None
            section.__exit__(None, None, None)


def _refuse_lightning_requeue(trainer: pl.Trainer) -> None:
    # The environment Lightning's signal connector reads when it installs its requeue handler
    # (a single-device strategy has none of its own).
    connector = getattr(trainer, "_accelerator_connector", None)
    environment = getattr(connector, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        raise LightningConflict(
            "Lightning's SLURMEnvironment(auto_requeue=True) would requeue the job on SIGUSR1, "
            "the signal slurmft uses for its coordinated save, behind the slurmft daemon's back. "
            "Under `slurmft submit` leave the environment to Lightning (it detects torchrun), or "
            "pass SLURMEnvironment(auto_requeue=False)"
        )


def _resumable_loaders(trainer: pl.Trainer) -> list[ResumableLoader]:
    loaders = trainer.train_dataloader
    flat: Iterator[Any]
    if loaders is None:
        return []
    if isinstance(loaders, DataLoader):
        flat = iter([loaders])
    elif hasattr(loaders, "flattened"):
        flat = iter(loaders.flattened)
    elif isinstance(loaders, Mapping):
        flat = iter(loaders.values())
    else:
        flat = iter(loaders)
    return [loader for loader in flat if isinstance(loader, ResumableLoader)]


def _schedule_of(trainer: pl.Trainer) -> dict[str, Any]:
    """The LR schedule as this run's code configured it (read before a checkpoint's optimizer
    and scheduler states replace the values): each optimizer's class and starting LRs, each
    scheduler's class, interval, frequency and base LRs."""
    return {
        "optimizers": [
            {"class": type(opt).__name__, "lr": [float(g["lr"]) for g in opt.param_groups]}
            for opt in trainer.optimizers
        ],
        "schedulers": [
            {
                "class": type(config.scheduler).__name__,
                "interval": config.interval,
                "frequency": config.frequency,
                "base_lrs": [float(lr) for lr in getattr(config.scheduler, "base_lrs", [])],
            }
            for config in trainer.lr_scheduler_configs
        ],
    }


def _first_micro_batch(trainer: pl.Trainer, batch_idx: int) -> bool:
    return batch_idx % trainer.accumulate_grad_batches == 0


def _last_micro_batch(trainer: pl.Trainer, batch_idx: int) -> bool:
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0


def _checkpoint_folder(trainer: pl.Trainer) -> Path:
    """Where the coordinated save goes: the ModelCheckpoint's folder (where `ckpt_path="last"`
    finds it), else the Trainer's root."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return Path(callback.dirpath)
    return Path(trainer.default_root_dir)
