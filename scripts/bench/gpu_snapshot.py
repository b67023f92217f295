#!/usr/bin/env python3
"""On a GPU machine: what an in-memory snapshot of a ~1B-parameter model costs the training
stream, and whether a warm worker forked by the zygote can use CUDA. At most a few minutes.

1. Snapshot copy (`slurmft.train.snapshot.HostCopy`, what `MemorySnapshots` uses) of the state
   of a model of `--params` parameters, in two layouts:
   - fp32 + Adam: weights, exp_avg, exp_avg_sq in fp32 (12 bytes a parameter);
   - bf16 + fp32 master: bf16 weights, fp32 master weights and both moments (14 bytes);
   each to pinned host memory (HostCopy: queued on the training stream) and to pageable memory
   (`tensor.cpu()`, what a plain `torch.save` of GPU tensors does). For each: the time the
   training stream is blocked (CUDA events around the copies on it), the time the Python loop
   waited for the call to return, the time until the copy is complete, and GB/s; the first call
   (allocating and pinning the buffers) and the steady state (median of the next three).
2. The zygote: `python -m slurmft.agent.zygote` imports torch without initialising CUDA, and a
   worker it forks for `python -m slurmft.agent.warm_start` initialises CUDA and runs a matmul.

Imports only torch and what `slurmft.train.snapshot` and the zygote import (no msgspec, no
SQLAlchemy): run it from a checkout with `PYTHONPATH=.`.

    PYTHONPATH=. python3 scripts/bench/gpu_snapshot.py [--params 1e9]

The last line is `gpu_snapshot ...` with the steady figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slurmft.train.snapshot import HostCopy

CHUNK = 64 * 2**20  # parameters a tensor: a model is many tensors, not one


def state_of(params: int, layout: str) -> dict[str, list[torch.Tensor]]:
    sizes = [CHUNK] * (params // CHUNK) + ([params % CHUNK] if params % CHUNK else [])
    cuda = torch.device("cuda")

    def tensors(dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.ones(n, dtype=dtype, device=cuda) for n in sizes]

    if layout == "fp32+adam":
        return {"weights": tensors(torch.float32), "exp_avg": tensors(torch.float32),
                "exp_avg_sq": tensors(torch.float32)}  # fmt: skip
    return {"weights": tensors(torch.bfloat16), "master": tensors(torch.float32),
            "exp_avg": tensors(torch.float32), "exp_avg_sq": tensors(torch.float32)}  # fmt: skip


def nbytes(state: dict[str, list[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for ts in state.values() for t in ts)


def timed(copy: Callable[[], Callable[[], object]]) -> dict[str, float]:
    """One snapshot copy: stream blocked (events), loop waited (wall), complete (wall)."""
    stream = torch.cuda.current_stream()
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    before.record(stream)
    ready = copy()
    after.record(stream)
    returned = time.perf_counter()
    ready()
    after.synchronize()
    complete = time.perf_counter()
    return {"stream_s": before.elapsed_time(after) / 1000, "loop_s": returned - started,
            "complete_s": complete - started}  # fmt: skip


def measure(params: int, layout: str, memory: str) -> dict[str, float]:
    state = state_of(params, layout)
    size = nbytes(state)
    host = HostCopy()

    def pinned() -> Callable[[], object]:
        return host.copy(state)

    def pageable() -> Callable[[], object]:
        copied = {k: [t.cpu() for t in ts] for k, ts in state.items()}
        return lambda: copied

    runs = [timed(pinned if memory == "pinned" else pageable) for _ in range(4)]
    steady = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
    return {"gb": size / 1e9, **{f"first_{k}": v for k, v in runs[0].items()}, **steady,
            "gb_s": size / 1e9 / steady["complete_s"]}  # fmt: skip


ZYGOTE_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    assert torch.cuda.is_available()
    a = torch.randn(1024, 1024, device="cuda")
    value = float((a @ a).sum())
    print(f"forked worker pid {os.getpid()} zygote {os.environ.get('SLURMFT_WARM_START')}: "
          f"CUDA initialised, matmul sum {value:.1f} on {torch.cuda.get_device_name()}")
    """
)


def zygote_check() -> str:
    folder = Path(tempfile.mkdtemp(prefix="zygote-"))
    script, socket_path = folder / "train.py", folder / "z.sock"
    script.write_text(ZYGOTE_SCRIPT)
    zygote = subprocess.Popen(
        [sys.executable, "-u", "-m", "slurmft.agent.zygote", "--socket", str(socket_path),
         "--import", "torch", "--", str(script)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not socket_path.exists():
            if zygote.poll() is not None or time.monotonic() > deadline:
                return f"zygote did not start: {zygote.stderr.read() if zygote.stderr else ''}"
            time.sleep(0.1)
        env = {**os.environ, "SLURMFT_ZYGOTE_SOCKET": str(socket_path)}
        done = subprocess.run(
            [sys.executable, "-u", "-m", "slurmft.agent.warm_start", str(script)],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        return f"exit {done.returncode}: {done.stdout.strip()} {done.stderr.strip()[-500:]}"
    finally:
        zygote.kill()
        zygote.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    fields = []
    for layout in ("fp32+adam", "bf16+fp32-master"):
        for memory in ("pinned", "pageable"):
            r = measure(int(args.params), layout, memory)
            torch.cuda.empty_cache()  # the state measured is gone: its memory goes back
            print(f"{layout} to {memory} ({r['gb']:.1f} GB): first call stream "
                  f"{r['first_stream_s']:.3f} s, loop {r['first_loop_s']:.3f} s, complete "
                  f"{r['first_complete_s']:.3f} s; steady stream {r['stream_s']:.3f} s, loop "
                  f"{r['loop_s']:.3f} s, complete {r['complete_s']:.3f} s, {r['gb_s']:.1f} GB/s",
                  flush=True)  # fmt: skip
            key = f"{layout.split('+')[0]}_{memory}"
            fields += [f"{key}_stream_s={r['stream_s']:.3f}", f"{key}_gb_s={r['gb_s']:.1f}"]
    print(f"zygote: {zygote_check()}", flush=True)
    print("gpu_snapshot " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
