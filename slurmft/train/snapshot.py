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
the same on every node: `MemorySnapshots` refuses to run there (`replicated=False`), since a lost
node's shard would be on no survivor.

After a restart every rank reports the newest snapshot its node holds that checks out
(manifest, size, sha256); the newest one that is newer than the durable checkpoint wins, the
lowest rank holding it broadcasts it to all (a spare that joined receives it over the network),
and every rank loads it with its own RNG state. A snapshot that is missing, torn or corrupt on
every node falls back to the durable checkpoint, and the reason is returned (and journaled by
the caller). Durable checkpoints stay the only progress: a snapshot is never reported as one.

K is chosen from the measured cost: after each snapshot, K is the smallest number of steps
whose time the snapshot costs at most `budget` (3 %) of, given the median step time.

The folder is the agent's (`$SLURMFT_SNAPSHOT_DIR`, a tmpfs folder it creates and removes at
its end): the agent handles the files as bytes and never imports torch.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurmft.train.report import SNAPSHOT_DIR_ENV
from slurmft.train.rng import capture_rng_state

BUDGET = 0.03
KEEP = 2
SCHEMA = 1


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
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        manifest = {**manifest, "schema": SCHEMA, "step": step, "bytes": len(payload),
                    "sha256": hashlib.sha256(payload).hexdigest()}  # fmt: skip
        for name, data in ((_payload_name(step), payload),
                           (_manifest_name(step), json.dumps(manifest).encode())):  # fmt: skip
            partial = self.path / f".{name}.partial"
            partial.write_bytes(data)
            partial.rename(self.path / name)
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


def snapshot_every(snapshot_s: float, step_s: float, budget: float = BUDGET) -> int:
    """The fewest steps a snapshot costing `snapshot_s` may come every, to cost at most
    `budget` of the training time."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(snapshot_s / (budget * step_s)))


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
        self.step_times: list[float] = []
        self.last_step_at: float | None = None
        self.last_cost_s = 0.0

    # -- saving ----------------------------------------------------------------------------
    def after_step(
        self,
        step: int,
        state: Callable[[], dict[str, Any]],
        resume: Callable[[], dict[str, Any]],
        during: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> bool:
        """Collective on snapshot steps (every rank calls it after every step); `during` wraps
        the snapshot (a heartbeat phase). True when a snapshot was taken."""
        now = time.monotonic()
        if self.last_step_at is not None:
            self.step_times = [*self.step_times[-49:], now - self.last_step_at]
        self.last_step_at = now
        if not self.enabled or step % self.every != 0:
            return False
        started = time.monotonic()
        with during():
            self.save(step, state(), resume())
        self.last_cost_s = time.monotonic() - started
        self.last_step_at = time.monotonic()  # the snapshot is not the next step's time
        return True

    def save(self, step: int, state: dict[str, Any], resume: dict[str, Any]) -> None:
        """Collective: every rank's RNG state, and the costs K is chosen from, gathered (so
        every rank picks the same K: a rank on its own K would skip a collective)."""
        step_s = statistics.median(self.step_times) if self.step_times else 0.0
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (capture_rng_state(), self.last_cost_s, step_s))
        rngs = [rng for rng, _, _ in gathered]
        if not self.fixed_every:
            cost_s = max(cost for _, cost, _ in gathered)  # the slowest writer's last snapshot
            self.every = snapshot_every(cost_s, max(s for _, _, s in gathered), self.budget)
        if self.local_rank != 0 or self.folder is None:
            return
        buffer = io.BytesIO()
        torch.save(state, buffer)
        manifest = {"resume": resume, "rng": rngs, "world_size": dist.get_world_size()}
        self.folder.write(step, buffer.getvalue(), manifest)

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
        # NCCL moves device memory only; gloo host memory.
        device = torch.device("cuda", torch.cuda.current_device()) if (
            dist.get_backend() == "nccl") else torch.device("cpu")  # fmt: skip
        if held is not None:
            data = torch.frombuffer(bytearray(held[2]), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(data, src=source)
        return manifest, data.cpu().numpy().tobytes()
