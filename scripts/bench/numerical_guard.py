#!/usr/bin/env python3
"""What the numerical guard (slurmft.train.numerical) costs a step without a fault.

Starts --world processes on gloo (CPU) and times, per step, over --steps steps:
- `begin_step()`: the copy of the RNG states a re-run would need;
- `check()` on a finite step: one all-reduce of one float per rank;
- the optional gradient check (`torch.isfinite(flat).all()`) on --params float32 values;
- a training step of the example's size for scale (an MLP forward and backward on 16 samples).

Prints `numerical_guard world=… rng_copy_us=… check_us=… grad_check_us=… step_us=…` (medians,
rank 0). Run: .venv/bin/python scripts/bench/numerical_guard.py [--world 2] [--steps 500]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from slurmft.train.numerical import NumericalGuard


class _Quiet:
    def send(self, kind: str, **fields: object) -> bool:
        return True


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _worker(rank: int, world: int, steps: int, params: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    guard = NumericalGuard(_Quiet(), "record")  # type: ignore[arg-type]
    flat = torch.randn(params)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    x, y = torch.randn(16, 16), torch.randn(16, 1)
    rng, check, grads, step = [], [], [], []
    for _ in range(steps):
        began = time.perf_counter()
        guard.begin_step()
        rng.append(time.perf_counter() - began)
        dist.barrier()  # time the all-reduce, not the other ranks' lag behind this one
        began = time.perf_counter()
        guard.check(1, [], lambda: [])
        check.append(time.perf_counter() - began)
        began = time.perf_counter()
        bool(torch.isfinite(flat).all())
        grads.append(time.perf_counter() - began)
        began = time.perf_counter()
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        step.append(time.perf_counter() - began)
    if rank == 0:
        print(
            f"numerical_guard world={world} rng_copy_us={_median_us(rng):.1f} "
            f"check_us={_median_us(check):.1f} grad_check_us={_median_us(grads):.1f} "
            f"params={params} step_us={_median_us(step):.1f}",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--params", type=int, default=10_000_000, help="values in the grad check")
    parser.add_argument("--port", type=int, default=29731)
    args = parser.parse_args()
    mp.spawn(_worker, (args.world, args.steps, args.params, args.port), nprocs=args.world)


if __name__ == "__main__":
    main()
