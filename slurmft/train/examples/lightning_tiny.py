"""A tiny PyTorch Lightning run under slurmft: the usual LightningModule, plus SlurmftCallback
and ResumableLoader (slurmft.train.lightning).

    torchrun --standalone --nproc-per-node=2 -m slurmft.train.examples.lightning_tiny \
        --ckpt-dir /shared/ckpt --out-dir /tmp/out --steps 40 --ckpt-every 5

Synthetic regression data made in code, an MLP with dropout (so the RNG matters), Adam with a
step LR schedule, DDP on gloo (NCCL where there are GPUs). Lightning writes `last.ckpt` every
`--ckpt-every` steps and the run resumes from it (`ckpt_path="last"`). Rank 0 appends one JSON
line per step to `<out-dir>/losses.jsonl`: the step, its loss on rank 0's batch, the LR, the
world size and when it ended. `--crash-at-step N` SIGKILLs rank `--fault-rank` at step N in the
first attempt of the workers (a test's injected fault; torchrun's restart resumes).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import TensorDataset

from slurmft.train.examples.framework_runs import (
    append_loss,
    crash_if_due,
    parse_args,
    regression_data,
)
from slurmft.train.lightning import ResumableLoader, SlurmftCallback


class TinyModule(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))

    def train_dataloader(self) -> ResumableLoader:
        data = TensorDataset(*regression_data(self.args.samples, self.args.seed))
        return ResumableLoader(data, batch_size=self.args.batch_size, seed=self.args.seed)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        if self.args.work_ms:
            time.sleep(self.args.work_ms / 1000)
        loss = nn.functional.mse_loss(self.net(x), y)
        step = self.trainer.global_step + 1
        if self.trainer.global_rank == 0:
            append_loss(self.args.out_dir, {
                "step": step,
                "loss": loss.item(),
                "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
                "world_size": self.trainer.world_size,
                "time": time.time(),
            })  # fmt: skip
        crash_if_due(self.args, step, self.trainer.global_rank)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.args.lr)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    pl.seed_everything(args.seed, workers=True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpus = torch.cuda.is_available()
    trainer = pl.Trainer(
        accelerator="gpu" if gpus else "cpu",
        devices=local,
        num_nodes=world // local,
        strategy=DDPStrategy(process_group_backend="nccl" if gpus else "gloo"),
        max_steps=args.steps,
        max_epochs=-1,
        use_distributed_sampler=False,  # ResumableLoader shards by rank itself
        callbacks=[
            ModelCheckpoint(
                dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_last=True
            ),
            SlurmftCallback(heartbeat_interval_s=args.heartbeat_interval_s),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule(args), ckpt_path="last")


if __name__ == "__main__":
    main()
