"""Cost of the rank -> agent report channel per call, and per training step.

    .venv/bin/python scripts/bench/report_channel.py [--calls 20000]

Cases: no agent configured (plain torchrun), agent socket path set but no agent (ENOENT), agent
present and reading, agent present but not reading (its queue full: EAGAIN). For each, the
per-call cost of `ReportChannel.send` with a typical step message, and a simulated step (a small
matmul, ~1 ms) with and without one send + one heartbeat progress per step.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slurmft.train.heartbeat import Heartbeat
from slurmft.train.report import ReportChannel

IDENTITY = {"rank": 0, "local_rank": 0, "world_size": 8, "run_id": "bench", "restart_count": 0}


def per_call_us(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    samples = []
    for _ in range(calls):
        began = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - began) / 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def step_work() -> Callable[[], object]:
    # numpy, not torch: only slurmft.train may import torch (the channel itself is torch-free).
    try:
        import numpy as np

        a = np.random.default_rng(0).standard_normal((256, 256))
        return lambda: a @ a
    except ImportError:
        return lambda: sum(i * i for i in range(20000))


def step_ms(
    work: Callable[[], object], report: Callable[[], object], steps: int
) -> tuple[float, float]:
    """Median step time without and with reporting, interleaved so load drift cancels out."""
    plain, reported = [], []
    for _ in range(steps):
        began = time.perf_counter()
        work()
        plain.append(time.perf_counter() - began)
        began = time.perf_counter()
        work()
        report()
        reported.append(time.perf_counter() - began)
    return statistics.median(plain) * 1000, statistics.median(reported) * 1000


class Reader:
    def __init__(self, path: Path, read: bool):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True) if read else None
        if self.thread:
            self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.sock.recv(65536)

    def close(self) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join()
        self.sock.close()


def bench_case(name: str, channel: ReportChannel, calls: int, steps: int) -> None:
    heartbeat = Heartbeat(channel)
    step = {"n": 0}

    def report() -> None:
        step["n"] += 1
        heartbeat.progress(step["n"])
        channel.send("step", step=step["n"], compute_s=0.2013, wait_s=0.0031, total_s=0.2051)

    median, p99 = per_call_us(
        lambda: channel.send("step", step=1, compute_s=0.2, wait_s=0.003, total_s=0.2), calls
    )
    work = step_work()
    plain, reported = step_ms(work, report, steps)
    print(
        f"{name:34s} send median {median:6.2f} us  p99 {p99:6.2f} us | step {plain:.3f} ms -> "
        f"{reported:.3f} ms ({(reported - plain) * 1000:+.1f} us) | sent {channel.stats.sent} "
        f"dropped {channel.stats.dropped} {channel.stats.drop_reasons}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "agent.sock"
        bench_case("no agent configured", ReportChannel("", IDENTITY), args.calls, args.steps)
        bench_case("socket set, agent absent", ReportChannel(str(sock), IDENTITY), args.calls,
                   args.steps)  # fmt: skip
        reader = Reader(sock, read=True)
        bench_case("agent present, reading", ReportChannel(str(sock), IDENTITY), args.calls,
                   args.steps)  # fmt: skip
        reader.close()
        sock.unlink()
        reader = Reader(sock, read=False)
        bench_case("agent present, queue full", ReportChannel(str(sock), IDENTITY), args.calls,
                   args.steps)  # fmt: skip
        reader.close()


if __name__ == "__main__":
    main()
