"""What the two framework examples (lightning_tiny, hf_tiny) share: their flags, their data, the
loss record rank 0 writes per step, and the injected crash."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-ms", type=float, default=0.0, help="simulated compute per step")
    p.add_argument("--heartbeat-interval-s", type=float, default=5.0)
    p.add_argument("--crash-at-step", type=int, default=0)
    p.add_argument("--fault-rank", type=int, default=1)
    return p.parse_args(argv)


def regression_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x @ w + noise, the same on every rank and every restart."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    w = torch.randn(16, 1, generator=generator)
    return x, x @ w + 0.1 * torch.randn(samples, 1, generator=generator)


def append_loss(out_dir: str, record: dict[str, Any]) -> None:
    """One line of `<out-dir>/losses.jsonl` (rank 0's)."""
    with (Path(out_dir) / "losses.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")


def crash_if_due(args: argparse.Namespace, step: int, rank: int) -> None:
    """SIGKILL the fault rank at the crash step, in the workers' first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if step == args.crash_at_step and rank == args.fault_rank and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
