"""Step timing: own compute apart from collective wait, and every rank's compute time shared.

On GPUs host timers only see kernel launches, so sections are timed with CUDA events on the
current stream; they are resolved one step later (no synchronisation in the step), so the compute
time a rank shares is the previous step's. On CPU the wall clock is exact and current.

Sharing: `all_reduce_with_telemetry` appends world_size + 1 slots to the gradient buffer the
script all-reduces anyway: rank r writes its compute time into slot r (zeros elsewhere) and its
save-request flag into the last slot; after the SUM every rank holds all compute times and knows
whether any rank asked for a save, at no extra collective. Scripts whose gradient reduction is
hidden (DDP, FSDP) call `exchange_telemetry` every K steps instead: one all_gather of two floats.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist

from slurmft.train.heartbeat import Heartbeat

# A step's CUDA events per section ("compute", "wait"): (start, end) of each timed stretch.
_Events: TypeAlias = "dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]]"


@dataclass(frozen=True)
class StepTiming:
    step: int
    compute_s: float  # own forward, backward, optimizer: what a straggler makes long
    wait_s: float  # inside collectives: mostly waiting for the slowest peer
    total_s: float  # wall clock of the whole step on the host


@dataclass(frozen=True)
class StepExchange:
    compute_s: list[float]  # indexed by rank in the group
    save_requested: bool


class StepTimer:
    """`start_step()`, then `with timer.compute():` / `with timer.wait():`, then `end_step()`."""

    def __init__(self, device: torch.device | None = None, heartbeat: Heartbeat | None = None):
        # With a heartbeat, the section ("compute"/"wait") goes into every heartbeat, so a rank
        # hung outside a collective can be told from its peers waiting for it inside one.
        self.heartbeat = heartbeat
        self.use_cuda_events = device is not None and device.type == "cuda"
        self._step = 0
        self._step_start = 0.0
        self._compute = 0.0
        self._wait = 0.0
        self._events: _Events = {}
        self._pending: tuple[int, float, _Events] | None = None
        self.last: StepTiming | None = None

    def start_step(self, step: int) -> None:
        self._step = step
        self._step_start = time.perf_counter()
        self._compute = self._wait = 0.0
        self._events = {"compute": [], "wait": []}

    @contextmanager
    def _section(self, kind: str) -> Iterator[None]:
        if self.heartbeat is not None:
            self.heartbeat.set_section(kind)
        yield from self._timed(kind)
        # Reset only on a normal exit. A section left by an error (a collective that timed out)
        # keeps its name: the heartbeats sent while the process unwinds and exits must still say
        # "wait", or a victim of the hang would read as a rank stuck outside any collective.
        if self.heartbeat is not None:
            self.heartbeat.set_section(None)

    def _timed(self, kind: str) -> Iterator[None]:
        if self.use_cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[kind].append((start, end))
            return
        began = time.perf_counter()
        yield
        elapsed = time.perf_counter() - began
        if kind == "compute":
            self._compute += elapsed
        else:
            self._wait += elapsed

    def compute(self) -> AbstractContextManager[None]:
        return self._section("compute")

    def wait(self) -> AbstractContextManager[None]:
        return self._section("wait")

    def current_compute_s(self) -> float:
        """Own compute so far in this step (CPU), or the last resolved step's (CUDA)."""
        if self.use_cuda_events:
            return self.last.compute_s if self.last else 0.0
        return self._compute

    def end_step(self) -> StepTiming | None:
        """The timing of this step (CPU) or of the previous one (CUDA; None on the first)."""
        total = time.perf_counter() - self._step_start
        if not self.use_cuda_events:
            self.last = StepTiming(self._step, self._compute, self._wait, total)
            return self.last
        previous, self._pending = self._pending, (self._step, total, self._events)
        if previous is None:
            return None
        step, previous_total, events = previous
        # The previous step's events have almost always completed; synchronizing on its last event
        # costs nothing then, and elapsed_time would raise on an event still pending.
        for pairs in events.values():
            if pairs:
                pairs[-1][1].synchronize()
        spent = {
            kind: sum(start.elapsed_time(end) for start, end in pairs) / 1000.0
            for kind, pairs in events.items()
        }
        self.last = StepTiming(step, spent["compute"], spent["wait"], previous_total)
        return self.last


def all_reduce_with_telemetry(
    flat: torch.Tensor,
    own_compute_s: float,
    save_requested: bool,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, StepExchange]:
    """SUM-all-reduce `flat` (e.g. flattened gradients) with the telemetry slots appended."""
    if flat.dtype not in (torch.float32, torch.float64):
        raise ValueError("telemetry slots need a float32/float64 buffer; use exchange_telemetry")
    world = dist.get_world_size(group)
    slots = torch.zeros(world + 1, dtype=flat.dtype, device=flat.device)
    slots[dist.get_rank(group)] = own_compute_s
    slots[world] = 1.0 if save_requested else 0.0
    buffer = torch.cat([flat.reshape(-1), slots])
    dist.all_reduce(buffer, group=group)
    telemetry = buffer[flat.numel() :].tolist()
    exchange = StepExchange([float(t) for t in telemetry[:world]], telemetry[world] > 0.5)
    return buffer[: flat.numel()].view_as(flat), exchange


def exchange_telemetry(
    own_compute_s: float,
    save_requested: bool,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> StepExchange:
    """One small all_gather: for scripts that cannot piggy-back on their gradient reduction."""
    world = dist.get_world_size(group)
    mine = torch.tensor([own_compute_s, float(save_requested)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return StepExchange([float(t[0]) for t in gathered], any(float(t[1]) > 0.5 for t in gathered))
