"""A tiny Hugging Face `Trainer` run under slurmft: the usual Trainer, plus
SlurmftTrainerCallback (slurmft.train.hf).

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node=2 -m slurmft.train.examples.hf_tiny \
        --ckpt-dir /shared/ckpt --out-dir /tmp/out --steps 40 --ckpt-every 5

Synthetic regression data made in code, a small torch module with dropout (so the RNG matters)
that returns its loss as a transformers model does, AdamW with linear warmup and decay, DDP on
gloo (NCCL where there are GPUs). The Trainer writes checkpoint-N every `--ckpt-every` steps
and resumes from the newest. Rank 0 appends one JSON line per step to
`<out-dir>/losses.jsonl`: the step, the loss the Trainer logged (the mean over the ranks), the
LR, the world size and the time. `--crash-at-step N` SIGKILLs rank `--fault-rank` at step N in
the first attempt of the workers (a test's injected fault; torchrun's restart resumes).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from slurmft.train.distributed import exit_on_collective_error, exit_without_teardown
from slurmft.train.examples.framework_runs import (
    append_loss,
    crash_if_due,
    parse_args,
    regression_data,
)
from slurmft.train.hf import SlurmftTrainerCallback


class Regression(Dataset[dict[str, torch.Tensor]]):
    """y = x @ w + noise, the same on every rank and every restart."""

    def __init__(self, samples: int, seed: int) -> None:
        self.x, self.y = regression_data(samples, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


class TinyRegressor(nn.Module):
    def __init__(self, work_ms: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        self.work_ms = work_ms

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        if self.work_ms and self.training:
            time.sleep(self.work_ms / 1000)
        prediction = self.net(x)
        out: dict[str, Any] = {"logits": prediction}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(prediction, labels)
        return out


class LossLog(TrainerCallback):
    """Rank 0 writes each step's logged loss; the fault rank dies at the crash step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            append_loss(self.args.out_dir, {
                "step": state.global_step, "loss": logs["loss"], "lr": logs.get("learning_rate"),
                "world_size": args.world_size, "time": time.time(),
            })  # fmt: skip

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        crash_if_due(self.args, state.global_step, args.process_index)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    set_seed(args.seed)  # before the model is made: its initial weights come from this seed
    gpus = torch.cuda.is_available()
    training = TrainingArguments(
        output_dir=args.ckpt_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=5,
        save_strategy="steps",
        save_steps=args.ckpt_every,
        logging_steps=1,
        report_to=[],
        seed=args.seed,
        use_cpu=not gpus,
        ddp_backend="nccl" if gpus else "gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callback = SlurmftTrainerCallback(heartbeat_interval_s=args.heartbeat_interval_s)
    trainer = Trainer(
        model=TinyRegressor(args.work_ms),
        args=training,
        train_dataset=Regression(args.samples, args.seed),
        callbacks=[callback, LossLog(args)],
    )
    folder = Path(args.ckpt_dir)
    resume = get_last_checkpoint(str(folder)) if folder.is_dir() else None  # type: ignore[no-untyped-call]
    with exit_on_collective_error(callback.channel):
        trainer.train(resume_from_checkpoint=resume)
    # Here, with the Trainer still alive: its DDP model holds the gloo group, and freeing them
    # as main() returns hung a finished rank here (slurmft.train.distributed says how); an
    # interpreter exit with the group alive can abort instead. Only after a clean finish: on an
    # error exit_on_collective_error has already left by os._exit, or the error propagates.
    exit_without_teardown()


if __name__ == "__main__":
    main()
