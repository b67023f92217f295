"""A plain torchrun training script: torch.distributed and nothing of slurmft.

    torchrun --standalone --nproc-per-node=3 slurmft/train/examples/plain.py \
        --ckpt-dir /shared/ckpt --out-dir /tmp/out --steps 40

It stands for any user's script: run it by its path (not with `-m`, which would import the
slurmft package around it). It sends no heartbeats and reports nothing; it only writes its own
checkpoint (`<ckpt-dir>/plain-<step>.pt`, written to a temporary name and renamed, so a file
that exists is whole) every `--ckpt-every` steps and resumes from the newest one. Rank 0
appends one JSON line per step to `<out-dir>/steps.jsonl` (step, world size, loss, when it
ended); every rank
appends one line per start to `<out-dir>/starts.jsonl` (rank, world size, its Slurm node, the
step it resumed from, and the slurmft modules loaded in its process: none). A lost peer makes
a collective fail: the script exits with an error and torchrun restarts it, with a spare in the
dead node's place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # slurmft exports SLURMFT_CKPT_DIR (the run's checkpoint directory) to every rank.
    ckpt_dir = os.environ.get("SLURMFT_CKPT_DIR")
    p.add_argument("--ckpt-dir", required=ckpt_dir is None, default=ckpt_dir)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--work-ms", type=float, default=0.0, help="simulated compute per step")
    p.add_argument("--pg-timeout-s", type=float, default=30.0)
    p.add_argument(
        "--crash-every",
        type=int,
        default=0,
        help="rank 0 exits with an error at every N-th step (after saving it, when that step "
        "saves; never at the step it resumed from): a script that keeps crashing",
    )
    return p.parse_args(argv)


def latest(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("plain-*.pt"))
    return found[-1] if found else None


def append(path: Path, record: dict[str, object]) -> None:
    with path.open("a") as stream:
        stream.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir, out_dir = Path(args.ckpt_dir), Path(args.out_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    checkpoint = latest(ckpt_dir)
    if checkpoint is not None:
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    loaded = sorted(m for m in sys.modules if m == "slurmft" or m.startswith("slurmft."))
    start = {
        "rank": rank,
        "world_size": world,
        "node": os.environ.get("SLURMD_NODENAME", ""),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "step": step,
        "slurmft": loaded,
        "ckpt_dir_env": os.environ.get("SLURMFT_CKPT_DIR"),
    }
    append(out_dir / "starts.jsonl", start)  # one short line: an atomic append

    while step < args.steps:
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(4, 8, generator=generator)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        time.sleep(args.work_ms / 1000.0)
        for p in model.parameters():
            grad = p.grad
            assert grad is not None  # backward() gave every parameter one
            dist.all_reduce(grad)  # a dead peer makes this raise: torchrun restarts us
            grad /= world
        optimizer.step()
        step += 1
        if rank == 0:
            record = {"step": step, "world_size": world, "loss": loss.item(), "time": time.time()}
            append(out_dir / "steps.jsonl", record)
            if step % args.ckpt_every == 0 or step == args.steps:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                partial = ckpt_dir / f".plain-{step:09d}.tmp"
                torch.save({**state, "step": step}, partial)
                os.replace(partial, ckpt_dir / f"plain-{step:09d}.pt")
            if args.crash_every and step % args.crash_every == 0 and step < args.steps:
                print(f"plain.py: crashing at step {step} (--crash-every)", flush=True)
                os._exit(3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
