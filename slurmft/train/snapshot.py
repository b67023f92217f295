"""In-memory snapshots: the training state every K steps in node-local memory (tmpfs), so a restart
replays at most K - 1 steps instead of everything since the last durable checkpoint.

    snapshots = MemorySnapshots()                        # $SLURMFT_SNAPSHOT_DIR, or off
    found = snapshots.restore(durable_step)              # collective, at start
    ...
    snapshots.after_step(step, state_fn, resume_fn)      # collective every K steps

What a snapshot holds: the model and optimizer state (`torch.save` of the state dict, as
replicated under DDP), the exact-resume state (sampler, LR schedule, step: `resume`), and the RNG
state of *every* rank (gathered), behind a manifest with the payload's size and sha256 (the
durable checkpoint's check). Local rank 0 of each node writes the node's copy; the state is the
same on every data-parallel replica, so every node that trained holds a full copy: replication
to another node comes with data parallelism itself. Sharded state (FSDP, tensor parallel) is not
the same on every node, and a lost node's shard would be on no survivor: `MemorySnapshots`
refuses it (`replicated=False`, or at the first snapshot, on every rank before any collective,
when the state holds a DTensor or a ShardedTensor: `ShardedState`).

After a restart every rank reports the newest snapshot its node holds that checks out
(manifest, size, sha256); the newest one that is newer than the durable checkpoint wins, the
lowest rank holding it broadcasts it to all (a spare that joined receives it over the network),
and every rank loads it with its own RNG state. A snapshot that is missing, torn or corrupt on
every node falls back to the durable checkpoint, and the reason is returned (and journaled by
the caller). Durable checkpoints stay the only progress: a snapshot is never reported as one.

The training loop waits only for a copy: the state's tensors go into host buffers allocated at
the first snapshot and reused (pinned when the state is on a GPU: the copy is queued on the
training stream and the loop goes on), the RNG states are gathered by an asynchronous
collective, and a background thread waits for both, then serializes into the file itself
(`torch.save` to a path lets go of the GIL; into memory it does not), hashes it from the file and
renames it into place. The next snapshot first waits for that write. A worker killed in the
middle of a write leaves a partial file that is never read: the snapshot before it serves.

K is chosen from the measured cost: the time the loop waited (not counting a wait for the write
before), plus what the steps lost while the write went on beside them (on a CPU it shares the
cores and memory bandwidth), the mean of the last twenty. At each snapshot K is the smallest
number of steps whose time that cost is at most AIM (half) of `budget` (3 %) of, given the
median step without a write beside it, and such that the last write took at most AIM of the
time between two, so the writes never queue behind each other. The numbers come from every rank
(the previous gather), so every rank picks the same K.

The folder is the agent's (`$SLURMFT_SNAPSHOT_DIR`, a tmpfs folder it creates and removes at
its end): the agent handles the files as bytes and never imports torch.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import math
import os
import statistics
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurmft.train.report import SNAPSHOT_DIR_ENV
from slurmft.train.rng import capture_rng_state

log = logging.getLogger(__name__)

BUDGET = 0.03
# K aims at half the budget, as a bound is kept: a snapshot's cost varies from one to the next,
# and is measured against steps whose time varies by a few percent anyway. Measured, 256 MB on
# two cores: aimed at the whole budget, the loop ran over it in about half the measurements.
AIM = 1 / 2
KEEP = 2
# K is taken from the mean of a rank's last few costs, each the wait plus the signed loss of the
# steps beside the write against the mean step without one. The steps' own spread (a 100 ms
# step varies by +-5 ms; one that writes a durable checkpoint takes tens of ms more) lands beside
# a write as often as not, so it evens out in the mean, over enough snapshots; a write's cost
# has a long tail (a 256 MB write now and then slows its step by 50 ms, not 10), which a median
# would drop. The loss's mean is taken as at least 0: a write does not speed steps up.
# Measured: the largest of the last three made K 5 for a tiny model where 1 or 2 kept the
# budget; the median of the last five made it 15 for 256 MB, where the loop then ran 5.5 % slower.
# What the steps beside a write lost is counted up to the write's own duration: a write cannot
# take more from the loop than the time it ran beside it, and a step that is slow for reasons of
# its own (a durable checkpoint) lands beside a short write now and then. Uncapped, one such
# step in the mean of a few costs tripled K (a 4.5 ms wait beside 20 ms steps, a 100 ms step
# every 7th: K 46 and 54 where 17 kept the budget, in 2 runs of 20).
RECENT_COSTS = 20
SCHEMA = 1
# Each rank's gathered record (RNG state and costs, JSON) travels in a fixed-size slot: its
# length first, then the bytes. The slot is sized at the first snapshot (every rank agrees on
# it through one object gather) with room to spare: the JSON of an RNG state barely varies.
_LENGTH = struct.Struct("<q")
_SLOT_ROOM = 2


@dataclass(frozen=True)
class Restored:
    step: int
    resume: dict[str, Any]
    rng: dict[str, Any]  # this rank's
    source_rank: int


@dataclass(frozen=True)
class Outcome:
    """What `restore` found: a snapshot to load (`restored`), or why the durable checkpoint
    stays the place to resume from (`reason`)."""

    restored: Restored | None
    reason: str


def _payload_name(step: int) -> str:
    return f"step-{step:09d}.pt"


def _manifest_name(step: int) -> str:
    return f"step-{step:09d}.json"


class SnapshotFolder:
    """One node's snapshots: write (payload, then manifest, each renamed into place), list,
    check, prune. Bytes only: no torch here."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, step: int, payload: bytes, manifest: dict[str, Any]) -> None:
        self.write_with(step, lambda path: path.write_bytes(payload), manifest)

    def write_with(
        self, step: int, save: Callable[[Path], object], manifest: dict[str, Any]
    ) -> None:
        """`save` writes the payload into the path it is given; it is then hashed from the file
        (so it is never held twice in memory) and renamed into place, then its manifest."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        payload = self.path / f".{_payload_name(step)}.partial"
        try:
            save(payload)
            with payload.open("rb") as file:
                sha256 = hashlib.file_digest(file, "sha256").hexdigest()
        except BaseException:
            payload.unlink(missing_ok=True)  # in tmpfs a partial file holds RAM
            raise
        manifest = {**manifest, "schema": SCHEMA, "step": step,
                    "bytes": payload.stat().st_size, "sha256": sha256}  # fmt: skip
        payload.rename(self.path / _payload_name(step))
        partial = self.path / f".{_manifest_name(step)}.partial"
        partial.write_bytes(json.dumps(manifest).encode())
        partial.rename(self.path / _manifest_name(step))
        self.prune(KEEP)

    def steps(self) -> list[int]:
        found = []
        for path in self.path.glob("step-*.json"):
            try:
                found.append(int(path.stem.removeprefix("step-")))
            except ValueError:
                continue
        return sorted(found, reverse=True)

    def read(self, step: int) -> tuple[dict[str, Any], bytes]:
        """The manifest and payload of a snapshot that checks out; ValueError says why not."""
        try:
            manifest = json.loads((self.path / _manifest_name(step)).read_bytes())
            payload = (self.path / _payload_name(step)).read_bytes()
        except (OSError, ValueError) as error:
            raise ValueError(f"snapshot of step {step} unreadable: {error}") from error
        if manifest.get("schema") != SCHEMA or manifest.get("step") != step:
            raise ValueError(f"snapshot of step {step}: unknown manifest")
        if len(payload) != manifest.get("bytes"):
            raise ValueError(f"snapshot of step {step}: {len(payload)} bytes, not as written")
        if hashlib.sha256(payload).hexdigest() != manifest.get("sha256"):
            raise ValueError(f"snapshot of step {step}: checksum mismatch")
        return manifest, payload

    def newest_valid(self, newer_than: int) -> tuple[int, dict[str, Any], bytes] | str | None:
        """The newest snapshot past `newer_than` that checks out; a string says why the newest
        did not (it falls back to the next)."""
        rejected = ""
        for step in self.steps():
            if step <= newer_than:
                break
            try:
                manifest, payload = self.read(step)
            except ValueError as error:
                rejected = rejected or str(error)
                continue
            return step, manifest, payload
        return rejected or None

    def prune(self, keep: int) -> None:
        for step in self.steps()[keep:]:
            for name in (_manifest_name(step), _payload_name(step)):
                (self.path / name).unlink(missing_ok=True)


def snapshot_every(
    snapshot_s: float, step_s: float, budget: float = BUDGET, write_s: float = 0.0
) -> int:
    """The fewest steps a snapshot costing `snapshot_s` may come every, to cost at most
    `budget` of the training time (aiming at AIM of it), and for its write (`write_s`) to take
    at most AIM of the time between two (so the writes never queue behind each other)."""
    if step_s <= 0:
        return 1
    by_cost = math.ceil(round(snapshot_s / (AIM * budget * step_s), 9))  # 150.00000000000003
    by_write = math.ceil(round(write_s / (AIM * step_s), 9))
    return max(1, by_cost, by_write)


class ShardedState(ValueError):
    """The state holds a distributed tensor: a node's snapshot would not be the whole state."""


def check_replicated(state: Any, path: str = "") -> None:
    """Raise ShardedState when ``state`` holds a DTensor or a ShardedTensor (FSDP's and tensor
    parallelism's): a shard is on its node alone, and a lost node's snapshot would go with it."""
    if isinstance(value := state, torch.Tensor):
        kind = type(value).__name__
        if kind in ("DTensor", "ShardedTensor"):
            raise ShardedState(
                f"in-memory snapshots need state replicated on every node (DDP): {path or '/'} "
                f"is a {kind}"
            )
        return
    if isinstance(state, dict):
        for key, item in state.items():
            check_replicated(item, f"{path}/{key}")
    elif isinstance(state, list | tuple):
        for index, item in enumerate(state):
            check_replicated(item, f"{path}/{index}")


class HostCopy:
    """Host copies of a state's tensors, allocated at the first copy and reused while shapes
    and dtypes stay; pinned when the tensor is on a GPU, so the copy is queued on the training
    stream without the loop waiting for it (`ready` waits)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, state: Any) -> Callable[[], Any]:
        """Start copying ``state``; returns what waits for the copy and gives it."""
        on_gpu: list[bool] = []
        copied = self._copy(state, "", on_gpu)
        done = None
        if any(on_gpu):
            done = torch.cuda.Event()
            done.record()

        def ready() -> Any:
            if done is not None:
                done.synchronize()
            return copied

        return ready

    def _copy(self, value: Any, path: str, on_gpu: list[bool]) -> Any:
        if isinstance(value, torch.Tensor):
            held = self._buffers.get(path)
            if held is None or held.shape != value.shape or held.dtype != value.dtype:
                held = torch.empty(
                    value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda
                )
                self._buffers[path] = held
            held.copy_(value.detach(), non_blocking=value.is_cuda)
            on_gpu.append(value.is_cuda)
            return held
        if type(value) is dict:
            return {key: self._copy(item, f"{path}/{key}", on_gpu) for key, item in value.items()}
        if type(value) in (list, tuple):
            items = (self._copy(item, f"{path}/{i}", on_gpu) for i, item in enumerate(value))
            return type(value)(items)
        return copy.deepcopy(value)


class _Gather:
    """One asynchronous gather of every rank's record (RNG state and costs) in fixed slots."""

    def __init__(self, record: dict[str, Any], slot: int, device: torch.device):
        data = json.dumps(record).encode()
        fits = _LENGTH.size + len(data) <= slot
        mine = torch.zeros(slot, dtype=torch.uint8)
        mine[: _LENGTH.size] = torch.frombuffer(
            bytearray(_LENGTH.pack(len(data) if fits else -1)), dtype=torch.uint8
        )
        if fits:
            mine[_LENGTH.size : _LENGTH.size + len(data)] = torch.frombuffer(
                bytearray(data), dtype=torch.uint8
            )
        mine = mine.to(device)
        self.slots = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        self.work = dist.all_gather(self.slots, mine, async_op=True)
        self._records: list[dict[str, Any] | None] | None = None

    def records(self) -> list[dict[str, Any] | None]:
        """Every rank's record (None: it did not fit its slot). Waits for the gather; decoded
        once (the writer's thread reads them, then the next snapshot's K)."""
        if self._records is not None:
            return self._records
        assert self.work is not None
        self.work.wait()
        found: list[dict[str, Any] | None] = []
        for slot in self.slots:
            raw = slot.cpu().numpy().tobytes()
            (length,) = _LENGTH.unpack_from(raw)
            found.append(
                None if length < 0 else json.loads(raw[_LENGTH.size : _LENGTH.size + length])
            )
        self._records = found
        return found


class MemorySnapshots:
    def __init__(
        self,
        folder: str | None = None,
        every: int = 0,  # 0: chosen from the measured cost
        budget: float = BUDGET,
        replicated: bool = True,
    ):
        path = folder if folder is not None else os.environ.get(SNAPSHOT_DIR_ENV, "")
        if path and not replicated:
            raise ValueError("in-memory snapshots need state replicated on every node (DDP)")
        self.enabled = bool(path) and dist.is_initialized()
        self.folder = SnapshotFolder(Path(path)) if path else None
        self.fixed_every = every
        self.every = every or 1
        self.budget = budget
        self.rank = dist.get_rank() if self.enabled else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.writes = self.enabled and self.local_rank == 0 and self.folder is not None
        self.step_times: list[float] = []  # steps with no write going on beside them
        self.writing_step_times: list[float] = []
        self.last_step_at: float | None = None
        self.last_cost_s = 0.0  # the loop's last wait
        # A snapshot's whole cost: the loop's wait, plus what the steps lost while its write
        # went on beside them (on a CPU it shares the cores and memory bandwidth; on a GPU
        # next to nothing). Known once the write is done; K is taken from the mean of the last
        # few.
        self.recent_costs: list[float] = []
        self.recent_waits: list[float] = []  # the same snapshots' waits
        self._unsettled_wait: float | None = None
        self._beside_write: list[float] = []  # the steps beside the last write
        self._blocked_s = 0.0  # the last snapshot's wait for the write before it
        self._write_s = 0.0  # the last write's duration, copy to rename (0: none done here)
        self._writing = False
        self.last_error = ""  # why the last write failed ("" if it did not)
        self._slot = 0
        self._host = HostCopy()
        self._pending_gather: _Gather | None = None
        self._pending_write: Future[None] | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="slurmft-snapshot") if (
            self.writes) else None  # fmt: skip

    # -- saving ----------------------------------------------------------------------------
    def after_step(
        self,
        step: int,
        state: Callable[[], dict[str, Any]],
        resume: Callable[[], dict[str, Any]],
        during: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> bool:
        """Collective on snapshot steps (every rank calls it after every step); `during` wraps
        the wait (a heartbeat phase). True when a snapshot was started."""
        now = time.monotonic()
        if self.last_step_at is not None:
            self._count_step(now - self.last_step_at)
        self.last_step_at = now
        if not self.enabled or step % self.every != 0:
            return False
        first = not self._slot
        started = time.monotonic()
        with during():
            self.save(step, state(), resume())
        self.last_cost_s = time.monotonic() - started
        # The first pays once for the buffers and the slot size: not K's business. Nor is the
        # wait for the previous write: K keeps the writes apart (from their duration).
        self._unsettled_wait = None if first else self.last_cost_s - self._blocked_s
        self._beside_write = []
        self._writing = self._pending_write is not None
        self.last_step_at = time.monotonic()  # the snapshot is not the next step's time
        return True

    def _count_step(self, took: float) -> None:
        if not self._writing:
            self.step_times = [*self.step_times[-49:], took]
            return
        self.writing_step_times = [*self.writing_step_times[-49:], took]
        self._beside_write.append(took)
        if self._pending_write is None or self._pending_write.done():
            self._writing = False

    def _typical_cost_s(self) -> float:
        """The mean of the recent costs, at least the mean of their waits (see RECENT_COSTS)."""
        if not self.recent_costs:
            return 0.0
        return max(statistics.fmean(self.recent_waits), statistics.fmean(self.recent_costs))

    def _slowed_s(self) -> float:
        """What the steps beside the last write lost: their time over the mean step without a
        write beside it, signed, so a step's own spread evens out in the mean of the costs K is
        taken from (counting only the slower steps made that spread a cost of its own)."""
        base = self._base_step_times()
        if not self._beside_write or not base:
            return 0.0
        mean = statistics.fmean(base)
        return sum(took - mean for took in self._beside_write)

    def _step_s(self) -> float:
        """The median step with no write beside it."""
        times = self._base_step_times()
        return statistics.median(times) if times else 0.0

    def _base_step_times(self) -> list[float]:
        """The recent steps with no write beside them; while every step has one (K = 1, or
        writes longer than K steps), the steps beside the writes."""
        return self.step_times or self.writing_step_times

    def save(self, step: int, state: dict[str, Any], resume: dict[str, Any]) -> None:
        """Collective: waits for the previous snapshot, takes K from what the previous gather
        shared, then starts this one: the copy, the gather of every rank's RNG state and
        costs, and (one rank per node) the write in the background."""
        blocked_from = time.monotonic()
        self.flush()
        self._blocked_s = time.monotonic() - blocked_from
        if self._unsettled_wait is not None:  # the previous snapshot's write is done now
            # Below the wait at times (see RECENT_COSTS); never more than the write lasted.
            cost_s = self._unsettled_wait + min(self._slowed_s(), self._write_s)
            self.recent_costs = [*self.recent_costs[-(RECENT_COSTS - 1) :], cost_s]
            self.recent_waits = [*self.recent_waits[-(RECENT_COSTS - 1) :], self._unsettled_wait]
            self._unsettled_wait = None
        previous, self._pending_gather = self._pending_gather, None
        if previous is not None and not self.fixed_every:
            self.every = self._every_from(previous.records())
        step_s = self._step_s()
        if not self._slot:
            # Every rank, before any collective: one refusing alone would leave the others
            # waiting in the gather. The state's structure does not change between snapshots.
            check_replicated(state)
        cost_s = self._typical_cost_s()
        record = {"rng": capture_rng_state(), "cost_s": cost_s, "step_s": step_s,
                  "write_s": self._write_s}  # fmt: skip
        if not self._slot:
            self._slot = self._agree_on_slot(record)
        gather = _Gather(record, self._slot, self._device())
        self._pending_gather = gather
        if not self.writes:
            return
        copied = self._host.copy(state)
        assert self._writer is not None
        manifest = {"resume": copy.deepcopy(resume), "world_size": dist.get_world_size()}
        self._pending_write = self._writer.submit(
            self._write, step, copied, manifest, gather, time.monotonic()
        )

    def flush(self) -> None:
        """Wait for the snapshot being written (a fault injected after a step, a clean end)."""
        pending, self._pending_write = self._pending_write, None
        if pending is not None:
            pending.result()

    def _write(
        self, step: int, copied: Callable[[], Any], manifest: dict[str, Any], gather: _Gather,
        started: float,
    ) -> None:  # fmt: skip
        """In the background: every rank's RNG state, the copy, serialized, hashed, written."""
        try:
            self._write_payload(step, copied, manifest, gather)
        finally:
            self._write_s = time.monotonic() - started

    def _write_payload(
        self, step: int, copied: Callable[[], Any], manifest: dict[str, Any], gather: _Gather
    ) -> None:
        assert self.folder is not None
        records = gather.records()
        if any(record is None for record in records):
            self.last_error = f"snapshot of step {step} not written: an RNG state outgrew its slot"
            log.warning(self.last_error)
            return
        state = copied()
        manifest = {**manifest, "rng": [record["rng"] for record in records if record is not None]}
        try:
            # Into the file itself: torch.save into a BytesIO holds the GIL while it copies
            # (measured, 256 MB on two cores: the steps beside it lost 0.11 s; to a file 0.02 s).
            self.folder.write_with(step, lambda path: torch.save(state, path), manifest)
        except (OSError, RuntimeError) as error:
            # A full tmpfs (torch.save reports a failed write as a RuntimeError): training goes
            # on, the durable checkpoint serves.
            self.last_error = f"snapshot of step {step} not written: {error}"
            log.warning(self.last_error)
        else:
            self.last_error = ""

    def _every_from(self, records: list[dict[str, Any] | None]) -> int:
        known = [record for record in records if record is not None]
        if len(known) != len(records):
            return self.every
        cost_s = max(record["cost_s"] for record in known)  # the slowest rank's wait
        step_s = max(record["step_s"] for record in known)
        write_s = max(record["write_s"] for record in known)  # the slowest node's write
        return snapshot_every(cost_s, step_s, self.budget, write_s)

    def _agree_on_slot(self, record: dict[str, Any]) -> int:
        sizes: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(sizes, len(json.dumps(record).encode()))
        return _LENGTH.size + _SLOT_ROOM * max(sizes)

    @staticmethod
    def _device() -> torch.device:
        # NCCL moves device memory only; gloo host memory.
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- restoring -------------------------------------------------------------------------
    def restore(self, durable_step: int | None) -> tuple[Outcome, dict[str, Any] | None]:
        """Collective. The newest snapshot newer than the durable checkpoint that some node
        holds and checks out, broadcast from the lowest rank holding it; with the state dict
        to load (None when the durable checkpoint stays the place to resume from)."""
        if not self.enabled or self.folder is None:
            return Outcome(None, "no snapshot folder"), None
        newer_than = -1 if durable_step is None else durable_step
        found = self.folder.newest_valid(newer_than) if self.local_rank == 0 else None
        mine = found if isinstance(found, tuple) else None
        why = found if isinstance(found, str) else ""
        offers: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(offers, (mine[0] if mine else -1, why))
        best = max(step for step, _ in offers)
        if best < 0:
            reasons = sorted({reason for _, reason in offers if reason})
            reason = "; ".join(reasons) or f"no snapshot newer than step {newer_than}"
            return Outcome(None, reason), None
        source = min(rank for rank, (step, _) in enumerate(offers) if step == best)
        manifest, payload = self._broadcast(source, mine if self.rank == source else None)
        # Every rank got the same bytes: each reaches the same verdict.
        if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
            why = f"snapshot of step {best} changed on its way from rank {source}"
            return Outcome(None, why), None
        if len(manifest["rng"]) != dist.get_world_size():
            return Outcome(None, f"snapshot of step {best} is of another world size"), None
        state = torch.load(io.BytesIO(payload), weights_only=True)
        restored = Restored(best, manifest["resume"], manifest["rng"][self.rank], source)
        return Outcome(restored, f"snapshot of step {best} from rank {source}"), state

    def _broadcast(
        self, source: int, held: tuple[int, dict[str, Any], bytes] | None
    ) -> tuple[dict[str, Any], bytes]:
        header: list[Any] = [None]
        if held is not None:
            header = [(held[1], len(held[2]))]
        dist.broadcast_object_list(header, src=source)
        manifest, size = header[0]
        device = self._device()
        if held is not None:
            data = torch.frombuffer(bytearray(held[2]), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(data, src=source)
        return manifest, data.cpu().numpy().tobytes()
