"""Hugging Face `Trainer` under slurmft: one callback.

    from slurmft.train import exit_on_collective_error, exit_without_teardown
    from slurmft.train.hf import SlurmftTrainerCallback

    callback = SlurmftTrainerCallback()
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    with exit_on_collective_error(callback.channel):     # a peer died -> exit 75 for the agent
        trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir) is not None)
    exit_without_teardown()   # a clean finish ends here: the teardown can hang (below)

`Trainer` already resumes exactly on its own at the same world size: its checkpoint-N folder
holds the weights, optimizer, scheduler, every rank's RNG and the step, and on resume it skips
the batches of the epoch already trained (the sampler's order comes from `seed` and the epoch).
The callback adds (docs/train.md, "Hugging Face Trainer"):
- phase heartbeats (init, step, eval, checkpoint, done) and per-step timing: compute is the
  forward pass, timed by hooks on the model (under DDP the backward overlaps the gradient
  all-reduce and cannot be split), wait is one small all-gather of every rank's compute time
  after the backward;
- stragglers named from those times;
- progress: every checkpoint-N folder the Trainer writes is reported once rank 0 has synced it;
- the coordinated save: Slurm's time-limit signal (SIGUSR1, or the agent's request file) on any
  rank makes every rank save at the same step (the Trainer's own save, `control.should_save`);
- the global batch and the LR schedule, written beside each checkpoint (`slurmft.json`) and
  checked unchanged when a run resumes from one.

The Trainer's model holds its gloo group after `train()`, and its teardown at the interpreter's
exit can hang or abort a finished rank (a failure to torchrun), so the script ends the rank with
`exit_without_teardown()` once `train()` has returned (slurmft.train.distributed).
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from slurmft.train.heartbeat import Heartbeat, Phase
from slurmft.train.report import ReportChannel
from slurmft.train.resume import TrainingContract, check_resume
from slurmft.train.save_request import SaveRequest
from slurmft.train.stacks import install_stack_dump
from slurmft.train.straggler import PeerGroups, StragglerDetector, StragglerNotices
from slurmft.train.timing import StepTimer, exchange_telemetry

CONTRACT_FILE = "slurmft.json"  # beside the Trainer's files in each checkpoint-N folder


class SlurmftTrainerCallback(TrainerCallback):
    """Heartbeats, step timing, stragglers, progress, the coordinated save and the resume check
    for a Hugging Face Trainer (see the module's docs).

    ``lr_schedule``: a JSON-able description of the LR schedule that must not change across
    restarts (default: the TrainingArguments that make it: learning_rate, lr_scheduler_type and
    its kwargs, warmup, max_steps, epochs, optimizer).
    """

    def __init__(
        self,
        *,
        lr_schedule: dict[str, Any] | None = None,
        heartbeat_interval_s: float = 5.0,
        deadlines_s: dict[Phase, float] | None = None,
        straggler_window: int = 10,
        allow_global_batch_change: bool = False,
        allow_lr_schedule_change: bool = False,
    ) -> None:
        self.lr_schedule = lr_schedule
        self.straggler_window = straggler_window
        self.allow_global_batch_change = allow_global_batch_change
        self.allow_lr_schedule_change = allow_lr_schedule_change
        # Made here, not at train begin: the script's `exit_on_collective_error(callback.channel)`
        # and the init phase start before the Trainer does.
        self.channel = ReportChannel()
        self.heartbeat = Heartbeat(self.channel, heartbeat_interval_s, deadlines_s or {})
        self.save_request = SaveRequest()
        self.timer: StepTimer | None = None
        self.stragglers: StragglerNotices | None = None
        self._hooks: list[Any] = []
        self._section: AbstractContextManager[None] | None = None
        self._save_agreed = False
        self.compute_times: list[float] | None = None

    # -- start and end ---------------------------------------------------------------------
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        install_stack_dump(args.process_index)
        self.heartbeat.enter(Phase.INIT)
        self.heartbeat.start()

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """The Trainer has loaded the checkpoint's state (global_step) by now."""
        self.heartbeat.start()  # a callback added after the Trainer was made missed on_init_end
        if state.global_step > 0:
            self._check_resume(args, state)
        self.timer = StepTimer(args.device, self.heartbeat)
        detector = StragglerDetector(PeerGroups.uniform(args.world_size), self.straggler_window)
        self.stragglers = StragglerNotices(
            self.channel, detector, speaks=state.is_world_process_zero
        )
        if model is not None:
            self._hooks = [
                model.register_forward_pre_hook(self._forward_starts),
                model.register_forward_hook(self._forward_ends),
            ]
        self.heartbeat.enter(Phase.STEP, state.global_step)
        if state.is_world_process_zero:
            print(f"slurmft: training from step {state.global_step} at world size "
                  f"{args.world_size}", flush=True)  # fmt: skip

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.heartbeat.enter(Phase.DONE, state.global_step)
        self.heartbeat.stop()

    # -- the step ------------------------------------------------------------------------------
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        assert self.timer is not None
        self.timer.start_step(state.global_step + 1)

    def _forward_starts(self, module: nn.Module, inputs: Any) -> None:
        if module.training and self.timer is not None:
            self._section = self.timer.compute()
            self._section.__enter__()

    def _forward_ends(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self._section is not None:
            section, self._section = self._section, None
            section.__exit__(None, None, None)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The backward is done: every rank's forward time and save request, one all-gather."""
        assert self.timer is not None
        pending = self.save_request.pending()
        if args.world_size > 1:
            with self.timer.wait():
                exchange = exchange_telemetry(self.timer.current_compute_s(), pending,
                                              device=args.device)  # fmt: skip
            self.compute_times = exchange.compute_s
            self._save_agreed |= exchange.save_requested
        else:
            self.compute_times = [self.timer.current_compute_s()]
            self._save_agreed |= pending

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        assert self.timer is not None
        timing = self.timer.end_step()
        self.heartbeat.progress(state.global_step)
        if timing is not None:
            self.channel.send("step", step=state.global_step, compute_s=timing.compute_s,
                              wait_s=timing.wait_s, total_s=timing.total_s)  # fmt: skip
        if self.stragglers is not None and self.compute_times is not None:
            self.stragglers.observe(state.global_step, self.compute_times)
        if self._save_agreed:  # every rank agreed in the same exchange: every rank saves now
            control.should_save = True
        if control.should_evaluate:
            self.heartbeat.enter(Phase.EVAL, state.global_step)
        elif control.should_save:
            self.heartbeat.enter(Phase.CHECKPOINT, state.global_step)
        return control

    # -- evaluation and checkpoints ------------------------------------------------------------
    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        phase = Phase.CHECKPOINT if control.should_save else Phase.STEP
        self.heartbeat.enter(phase, state.global_step)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The Trainer has written checkpoint-N (rank 0 its files, every rank its RNG)."""
        if self._save_agreed:
            self.save_request.clear()
            self._save_agreed = False
        if state.is_world_process_zero:
            folder = _checkpoint_folder(args, state)
            (folder / CONTRACT_FILE).write_text(json.dumps(self._contract(args).to_json()))
            _sync_folder(folder)
            self.channel.send("event", event="checkpoint_saved", step=state.global_step,
                              path=str(folder))  # fmt: skip
        self.heartbeat.enter(Phase.STEP, state.global_step)

    # -- the resume check ----------------------------------------------------------------------
    def _contract(self, args: TrainingArguments) -> TrainingContract:
        global_batch = (
            args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
        )
        schedule = self.lr_schedule if self.lr_schedule is not None else _schedule_of(args)
        return TrainingContract(global_batch, schedule)

    def _check_resume(self, args: TrainingArguments, state: TrainerState) -> None:
        folder = _checkpoint_folder(args, state)
        saved = folder / CONTRACT_FILE
        if not saved.is_file():
            return  # a checkpoint from a run without the callback: nothing to compare with
        check_resume(
            json.loads(saved.read_text()),
            self._contract(args),
            checkpoint=str(folder),
            allow_global_batch_change=self.allow_global_batch_change,
            allow_lr_schedule_change=self.allow_lr_schedule_change,
        )


def _schedule_of(args: TrainingArguments) -> dict[str, Any]:
    """The TrainingArguments that make the LR schedule (this run's code's values)."""
    return {
        "learning_rate": float(args.learning_rate),
        "lr_scheduler_type": str(args.lr_scheduler_type),
        "lr_scheduler_kwargs": args.lr_scheduler_kwargs or {},
        "warmup_steps": args.warmup_steps,
        "warmup_ratio": float(getattr(args, "warmup_ratio", 0.0) or 0.0),
        "max_steps": args.max_steps,
        "num_train_epochs": float(args.num_train_epochs),
        "optim": str(args.optim),
    }


def _checkpoint_folder(args: TrainingArguments, state: TrainerState) -> Path:
    """The Trainer's checkpoint-N folder for the current step."""
    return Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def _sync_folder(folder: Path) -> None:
    """rank 0's files of a checkpoint and the folder's entries durable before it is reported
    (another rank syncs nothing here: its RNG file is small and written before its next step)."""
    for path in folder.iterdir():
        if path.is_file():
            with path.open("rb") as written:
                os.fsync(written.fileno())
    for directory in (folder, folder.parent):
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
