#!/usr/bin/env python3
"""What an in-memory snapshot (slurmft.train.snapshot) costs, against the size of the state.

For each size (parameters + Adam's two moments, fp32: 12 bytes a parameter), one process (gloo,
world size 1) trains an MLP of that many parameters on the CPU and measures:
- the step time (forward, backward, Adam step; median of 5);
- a snapshot on its own (`MemorySnapshots.save`, then `flush`): the loop's wait (the copy into
  host buffers and the gather's start), first call and steady, and the time until it is
  written (serialize, sha256, write and rename in tmpfs, in the background);
- then the training loop itself with snapshots at the K the code picks (`after_step`, 3 %
  budget), until K is settled (3 snapshots running) or 3 minutes pass: the K, the loop's wait
  per snapshot, and the wait per step (the waits over the steps' own time);
- then the whole cost at that K: blocks of steps with a snapshot every K steps (K steps a
  block, or as many times K as make 5 s), alternating with blocks of as many steps without
  (`--pairs`, within `--compare-s`), the one's time over the other's. That holds the waits and
  the steps slowed beside the background write, which shares the CPU and memory bandwidth
  here; on a GPU the write shares nothing with the training stream.
Then two processes measure the restore's broadcast of a snapshot from one rank to the other
(the way a spare receives it): bytes a second.

    .venv/bin/python scripts/bench/snapshot.py [--sizes-mb 16,256,1024]

The last line is `snapshot overhead_pct=.. (per size) broadcast_mb_s=..`.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slurmft.train.snapshot import MemorySnapshots

BYTES_PER_PARAMETER = 12  # fp32 weights + Adam's exp_avg and exp_avg_sq
BLOCK_S = 5.0  # the least time a block of steps with (or without) snapshots runs for
WIDTH = 512  # 0.26 M parameters a layer: 3 MB of state


def model_of(size_mb: int) -> torch.nn.Module:
    parameters = size_mb * 2**20 // BYTES_PER_PARAMETER
    layers = max(1, parameters // (WIDTH * WIDTH))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def measure_alone(state: Callable[[], dict], folder: Path) -> tuple[list[float], list[float]]:
    """A snapshot on its own, 4 times: the loop's wait, and the time until it is written."""
    alone = MemorySnapshots(folder=str(folder), every=1)
    waits, written = [], []
    for n in range(1, 5):
        started = time.perf_counter()
        alone.save(n, state(), {"global_step": n})
        waits.append(time.perf_counter() - started)
        alone.flush()
        written.append(time.perf_counter() - started)
    return waits, written


def measure_size(size_mb: int, folder: Path, pairs: int, max_compare_s: float) -> dict[str, float]:
    torch.manual_seed(0)
    model = model_of(size_mb)
    optimizer = torch.optim.Adam(model.parameters())
    batch = torch.randn(32, WIDTH)

    def step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()
        return time.perf_counter() - started

    def state() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    step_s = statistics.median([step() for _ in range(6)][1:])
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    waits, written = measure_alone(state, folder / "alone")
    loop = MemorySnapshots(folder=str(folder / "loop"))
    ks, loop_waits = [], []
    n = 0

    def train_with_snapshots(steps: int) -> None:
        nonlocal n
        for _ in range(steps):
            n += 1
            step()
            if loop.after_step(n, state, lambda: {"global_step": n}):  # noqa: B023 (called now)
                loop_waits.append(loop.last_cost_s)
                ks.append(loop.every)

    # Until K settled (the same three times running), or 3 minutes: K moves with the cost.
    deadline = time.monotonic() + 180
    while len(ks) < 5 or (len(set(ks[-3:])) > 1 and time.monotonic() < deadline):
        train_with_snapshots(1)
    print(f"  K over the loop's snapshots: {ks}", flush=True)
    # Then the whole cost at the K the code picks: blocks of K steps with snapshots (each from
    # a snapshot step to the step before the next, so its write ends inside it) alternating
    # with blocks of as many steps without, compared as wholes: the waits, and the steps slowed
    # by the background write that shares the CPU (and the GIL) with them. A mean against a
    # mean: a median step would make the natural spread of step times look like overhead.
    every = loop.fixed_every = loop.every  # held: each block below holds whole intervals
    # A few seconds a block at least: short steps vary by more than a snapshot costs them.
    block_steps = every * max(1, math.ceil(BLOCK_S / (every * step_s)))
    with_s, without_s, blocks = 0.0, 0.0, []
    block_deadline = time.monotonic() + max_compare_s
    train_with_snapshots((-n - 1) % every)  # the next step takes a snapshot
    while len(blocks) < 2 * pairs and (len(blocks) < 2 or time.monotonic() < block_deadline):
        started = time.perf_counter()
        train_with_snapshots(block_steps)  # a snapshot at its first step, then every K
        loop.flush()  # its write is done by now, unless K is too small for it: then it counts
        took_with = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(block_steps):
            step()
        took_without = time.perf_counter() - started
        loop.last_step_at = None  # the steps above are not the loop's (no snapshot beside)
        with_s, without_s = with_s + took_with, without_s + took_without
        blocks += [took_with, took_without]
    loop_wait_s = statistics.median(loop_waits[-3:])
    pair_pct = [100 * (w / wo - 1) for w, wo in zip(blocks[::2], blocks[1::2], strict=True)]
    spread = statistics.stdev(pair_pct) / math.sqrt(len(pair_pct)) if len(pair_pct) > 1 else 0
    print(f"  K={every}, {block_steps} steps a block: {len(pair_pct)} pairs, slower with "
          f"snapshots by {', '.join(f'{pct:.1f} %' for pct in pair_pct)} (mean "
          f"{statistics.mean(pair_pct):.1f} %, standard error {spread:.1f}; median "
          f"{statistics.median(pair_pct):.1f} %)", flush=True)
    return {
        "state_mb": state_bytes / 2**20,
        "step_s": step_s,
        "first_wait_s": waits[0],
        "wait_s": statistics.median(waits[1:]),
        "written_s": statistics.median(written[1:]),
        "every": every,
        "loop_wait_s": loop_wait_s,
        "loop_step_s": without_s / (block_steps * len(pair_pct)),
        "overhead_pct": 100 * loop_wait_s * block_steps / every / (without_s / len(pair_pct)),
        "slowdown_pct": 100 * (with_s / without_s - 1),
        "write_mb_s": state_bytes / 2**20 / statistics.median(written[1:]),
    }


def broadcast_rank(rank: int, size_mb: int, port: int, out: dict[str, float]) -> None:
    init(rank, 2, port)
    data = torch.ones(size_mb * 2**20, dtype=torch.uint8) if rank == 0 else torch.empty(
        size_mb * 2**20, dtype=torch.uint8)  # fmt: skip
    dist.broadcast(data, src=0)  # a first one sets the connection up
    times = []
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(data, src=0)
        times.append(time.perf_counter() - started)
    if rank == 1:
        out["broadcast_mb_s"] = size_mb / statistics.median(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="16,256,1024")
    parser.add_argument("--broadcast-mb", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=3,
                        help="blocks with and without snapshots to compare, a pair at least")
    parser.add_argument("--compare-s", type=float, default=300,
                        help="a size's comparison stops after this many seconds (a pair at least)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init(0, 1, 29611)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    fields = []
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        folder = Path(tempfile.mkdtemp(prefix="snapshot-bench-", dir=shm))
        try:
            r = measure_size(size_mb, folder, args.pairs, args.compare_s)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"state {r['state_mb']:.0f} MB: step {r['step_s']:.3f} s; a snapshot alone: the "
              f"loop waits {r['first_wait_s']:.3f} s first, then {r['wait_s']:.3f} s, written "
              f"after {r['written_s']:.3f} s ({r['write_mb_s']:.0f} MB/s); in the loop: K="
              f"{r['every']:g}, wait {r['loop_wait_s']:.3f} s, overhead {r['overhead_pct']:.2f} "
              f"% of step time, step {r['loop_step_s']:.3f} s; the loop took "
              f"{r['slowdown_pct']:.1f} % longer than without snapshots", flush=True)
        fields.append(f"overhead_pct_{size_mb}mb={r['overhead_pct']:.2f}")
        fields.append(f"slowdown_pct_{size_mb}mb={r['slowdown_pct']:.1f}")
    dist.destroy_process_group()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(broadcast_rank, args=(args.broadcast_mb, 29612, out), nprocs=2, join=True)
        rate = out["broadcast_mb_s"]
    print(f"broadcast of {args.broadcast_mb} MB from one rank to another (gloo, loopback): "
          f"{rate:.0f} MB/s")
    print("snapshot " + " ".join(fields) + f" broadcast_mb_s={rate:.0f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
