"""Verified sharded checkpoints on torch.distributed.checkpoint, published atomically.

Save (a collective, at a step boundary):
  1. rank 0 creates `<root>/.staging-step-N/`; every rank writes its DCP shard there (fsynced by
     DCP) and its RNG state file, and computes the SHA-256 of the files it wrote;
  2. the digests are gathered to rank 0 (that gather is the barrier: every shard is on disk);
  3. rank 0 writes `manifest.json` (checksums + exact-resume state) durably and renames the
     staging directory to `<root>/step-N/`: the checkpoint exists all at once or not at all;
  4. rank 0 deletes checkpoints beyond the last `keep_last` and tells every rank the outcome.
Resume: rank 0 lists published checkpoints; newest first, every rank verifies its own files
(its shard and RNG file; a fair share when the world size changed); the first checkpoint that
verifies on all ranks is loaded, so a corrupted newest one falls back to the one before.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from slurmft.errors import SlurmftError
from slurmft.train.manifest import (
    MANIFEST_NAME,
    CheckpointInvalid,
    FileEntry,
    beyond_retention,
    build_manifest,
    checkpoint_name,
    digest_file,
    files_to_verify,
    fsync_path,
    published_checkpoints,
    read_manifest,
    staging_name,
    verify_files,
    write_json_durably,
)
from slurmft.train.report import ReportChannel, node_fenced
from slurmft.train.rng import capture_rng_state


class CheckpointDirNotShared(SlurmftError):
    """The checkpoint directory is not the same directory on every node."""


class CheckpointSaveFailed(SlurmftError):
    """Rank 0 could not prepare the checkpoint directory or publish a checkpoint."""


@dataclass(frozen=True)
class VerifiedCheckpoint:
    step: int
    path: Path
    manifest: dict[str, Any]
    skipped: tuple[str, ...] = ()  # newer checkpoints that failed verification, and why

    @property
    def resume(self) -> dict[str, Any]:
        resume: dict[str, Any] = self.manifest["resume"]
        return resume


def rng_file_name(rank: int) -> str:
    return f"rng/rank-{rank:05d}.json"


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_rank0_for_all(action: Callable[[], Any], what: str) -> Any:
    """Run `action` on rank 0 only; every rank gets its result, or raises if it failed (instead
    of waiting in the next collective for a rank 0 that has gone)."""
    result: tuple[Any, str | None] = (None, None)
    if dist.get_rank() == 0:
        try:
            result = (action(), None)
        except Exception as exc:
            result = (None, repr(exc))
    value, error = _broadcast(result)
    if error is not None:
        raise CheckpointSaveFailed(f"{what} failed on rank 0: {error}")
    return value


def _all_gather(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class CheckpointManager:
    """Collective save/verify/load of checkpoints under one shared directory."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int = 3,
        channel: ReportChannel | None = None,
        on_shards_written: Callable[[int], None] | None = None,
    ):
        if keep_last < 2:
            raise ValueError("keep_last must be >= 2 so that a corrupted newest has a fallback")
        self.root = Path(root)
        self.keep_last = keep_last
        self.channel = channel
        # Called on every rank after all shards are on disk and before the manifest is published;
        # tests kill a rank here to check that a partial save is never resumed from.
        self.on_shards_written = on_shards_written
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _report(self, event: str, **fields: Any) -> None:
        if self.channel is not None:
            self.channel.send("event", event=event, **fields)

    # -- start: the directory must be shared -------------------------------------------------
    def check_shared_directory(self, settle_s: float = 5.0) -> list[str]:
        """Rank 0 writes a nonce file; every rank must read it back. Collective.

        Also removes staging directories of saves that never completed; returns their names
        (on rank 0) so the script can log them.
        """
        nonce = _broadcast(secrets.token_hex(16))  # rank 0's nonce, known to every rank
        marker = self.root / f".slurmft-shared-check-{nonce}"

        def prepare() -> list[str]:
            self.root.mkdir(parents=True, exist_ok=True)
            removed = self._remove_stale_staging()
            write_json_durably(marker, {"nonce": nonce, "host": socket.gethostname()})
            return removed

        removed = _on_rank0_for_all(prepare, f"preparing the checkpoint directory {self.root}")
        seen = self._wait_for_marker(marker, nonce, settle_s)
        results = _all_gather((seen, socket.gethostname(), str(self.root.resolve())))
        if self.rank == 0:
            marker.unlink(missing_ok=True)
        blind = [(rank, host, path) for rank, (ok, host, path) in enumerate(results) if not ok]
        if blind:
            listing = ", ".join(f"rank {r} on {h} (sees {p})" for r, h, p in blind)
            raise CheckpointDirNotShared(
                f"the checkpoint directory {self.root} is not shared by all ranks: rank 0 on "
                f"{results[0][1]} wrote a check file there that {listing} cannot see. Use a "
                f"directory on a shared file system that shows the same files on every node; a "
                f"node-local path would make a restart on another node lose the checkpoints."
            )
        return removed or []

    def _wait_for_marker(self, marker: Path, nonce: str, settle_s: float) -> bool:
        # Shared file systems may show a new file on other nodes a moment later.
        deadline = time.monotonic() + settle_s
        while True:
            try:
                if json.loads(marker.read_text()).get("nonce") == nonce:
                    return True
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def _remove_stale_staging(self) -> list[str]:
        # Called at start only, when no save of this run can be in progress.
        removed = sorted(entry.name for entry in self.root.glob(".staging-step-*"))
        for name in removed:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return removed

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], resume: dict[str, Any]) -> Path:
        """Collective. `state` is a DCP state dict; `resume` the JSON exact-resume state."""
        staging = self.root / staging_name(step)

        def prepare() -> None:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / "rng").mkdir(parents=True)

        _on_rank0_for_all(prepare, f"creating {staging}")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(staging, sync_files=True))
        write_json_durably(staging / rng_file_name(self.rank), capture_rng_state())
        digests = _all_gather(self._digest_own_files(staging))  # also the "all written" barrier
        if self.on_shards_written is not None:
            self.on_shards_written(step)
        outcome = self._publish(step, staging, resume, digests) if self.rank == 0 else None
        outcome = _broadcast(outcome)
        if outcome is not None:
            raise CheckpointSaveFailed(f"checkpoint of step {step} was not published: {outcome}")
        final = self.root / checkpoint_name(step)
        self._report("checkpoint_saved", step=step, path=str(final))
        return final

    def _digest_own_files(self, staging: Path) -> dict[str, FileEntry]:
        own = [*sorted(staging.glob(f"__{self.rank}_*.distcp")), staging / rng_file_name(self.rank)]
        if self.rank == 0:
            own.append(staging / ".metadata")  # DCP's coordinator writes the metadata
        for path in own:
            fsync_path(path)
        return {str(p.relative_to(staging)): digest_file(p, self.rank) for p in own}

    def _publish(
        self, step: int, staging: Path, resume: dict[str, Any], digests: list[dict[str, FileEntry]]
    ) -> str | None:
        try:
            files = {name: entry for per_rank in digests for name, entry in per_rank.items()}
            manifest = build_manifest(step, self.world_size, resume, files)
            write_json_durably(staging / MANIFEST_NAME, manifest)
            fsync_path(staging / "rng")
            fsync_path(staging)
            final = self.root / checkpoint_name(step)
            if node_fenced():  # frozen past the others' patience: a new round owns the folder now
                raise CheckpointSaveFailed("this node was declared dead by its peers")
            shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step after a restart
            staging.rename(final)
            fsync_path(self.root)
            for old in beyond_retention(published_checkpoints(self.root), self.keep_last):
                shutil.rmtree(old, ignore_errors=True)
        except Exception as error:  # every rank must learn the outcome, or they would hang
            return repr(error)
        return None

    # -- resume ----------------------------------------------------------------------------
    def latest_verified(self) -> VerifiedCheckpoint | None:
        """Collective. The newest checkpoint every rank verified; None if there is none at all."""
        names = (
            [path.name for _, path in published_checkpoints(self.root)] if self.rank == 0 else []
        )
        names = _broadcast(names)
        problems_seen: list[str] = []
        invalid: list[Path] = []
        for name in names:
            path = self.root / name
            manifest, problems = self._verify_own_part(path)
            everyone = [p for per_rank in _all_gather(problems) for p in per_rank]
            if not everyone and manifest is not None:
                self._set_aside(invalid)
                return VerifiedCheckpoint(manifest["step"], path, manifest, tuple(problems_seen))
            invalid.append(path)
            problems_seen.append(f"{name}: {'; '.join(everyone[:3])}")
            self._report("checkpoint_invalid", path=str(path), problems=everyone[:10])
        if names:
            raise CheckpointInvalid(
                f"no checkpoint under {self.root} verifies ({' | '.join(problems_seen)}); "
                f"refusing to start from scratch over them. Move the directory away to start fresh."
            )
        return None

    def _set_aside(self, invalid: list[Path]) -> None:
        """Rename checkpoints newer than the one resumed from that failed verification, so they
        are kept for inspection but never tried again nor counted by retention. Rank 0 only;
        every rank has finished verifying them."""
        if self.rank != 0:
            return
        for path in invalid:
            target = path.with_name(f"invalid-{path.name}")
            shutil.rmtree(target, ignore_errors=True)
            path.rename(target)

    def _verify_own_part(self, path: Path) -> tuple[dict[str, Any] | None, list[str]]:
        try:
            manifest = read_manifest(path)
        except CheckpointInvalid as error:
            return None, [f"rank {self.rank}: {error}"]
        names = files_to_verify(manifest, self.rank, self.world_size)
        problems = verify_files(path, manifest, names)
        return manifest, [f"rank {self.rank}: {p}" for p in problems]

    def load(self, checkpoint: VerifiedCheckpoint, state: dict[str, Any]) -> dict[str, Any] | None:
        """Collective. Load `state` in place; return this rank's saved RNG state, if it has one."""
        dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint.path))
        rng_path = checkpoint.path / rng_file_name(self.rank)
        if checkpoint.manifest["world_size"] == self.world_size and rng_path.is_file():
            rng_state: dict[str, Any] = json.loads(rng_path.read_text())
            return rng_state
        return None  # a new world size: rank r is not the old rank r; the script reseeds
