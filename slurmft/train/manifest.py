"""Checkpoint manifests: checksums of every file and the exact-resume state, published atomically.

A checkpoint directory is valid only if its manifest parses, its own checksum matches, and every
file it lists has the recorded size and SHA-256. The directory only gets its final name after the
manifest is in it (see checkpoint.py), so a partial save is never a candidate for resume.

Torch-free: the agent and the controller can verify checkpoints without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.errors import SlurmftError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "slurmft-checkpoint"
MANIFEST_VERSION = 1
_PUBLISHED = re.compile(r"step-(\d{9})", re.ASCII)  # fullmatch: no final newline
_CHUNK = 1 << 20


class CheckpointInvalid(SlurmftError):
    """A checkpoint failed verification (missing, truncated, corrupted, or unpublished)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def staging_name(step: int) -> str:
    # A leading dot and a distinct prefix: never matched by _PUBLISHED, never resumed from.
    return f".staging-step-{step:09d}"


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int
    rank: int  # the global rank that wrote it (and verifies it when the world size is unchanged)

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.bytes, "rank": self.rank}


def digest_file(path: Path, rank: int) -> FileEntry:
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return FileEntry(sha.hexdigest(), size, rank)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, payload: dict[str, Any]) -> None:
    """Write to a temporary name, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as stream:
        json.dump(payload, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    tmp.replace(path)
    fsync_path(path.parent)


def _body_digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def build_manifest(
    step: int, world_size: int, resume: dict[str, Any], files: dict[str, FileEntry]
) -> dict[str, Any]:
    body = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "step": step,
        "world_size": world_size,
        "resume": resume,
        "files": {name: entry.to_json() for name, entry in sorted(files.items())},
    }
    return {**body, "manifest_sha256": _body_digest(body)}


def read_manifest(checkpoint_dir: Path) -> dict[str, Any]:
    path = checkpoint_dir / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise CheckpointInvalid(f"{checkpoint_dir}: no {MANIFEST_NAME}") from error
    except (OSError, ValueError) as error:
        raise CheckpointInvalid(f"{path}: unreadable manifest ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointInvalid(f"{path}: not a slurmft checkpoint manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise CheckpointInvalid(f"{path}: manifest version {manifest.get('version')} unsupported")
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    if _body_digest(body) != manifest.get("manifest_sha256"):
        raise CheckpointInvalid(f"{path}: manifest checksum mismatch (corrupted manifest)")
    return manifest


def files_to_verify(manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """The files this rank checks: its own when the world size is unchanged, else a fair share."""
    names = sorted(manifest["files"])
    if world_size == manifest["world_size"]:
        return [name for name in names if manifest["files"][name]["rank"] == rank]
    return names[rank::world_size]


def verify_files(checkpoint_dir: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """Problems found in `names` (empty when all match the manifest)."""
    problems = []
    for name in names:
        expected = manifest["files"][name]
        path = checkpoint_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        if path.stat().st_size != expected["bytes"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, expected {expected['bytes']}")
            continue
        if digest_file(path, expected["rank"]).sha256 != expected["sha256"]:
            problems.append(f"{name}: checksum mismatch")
    return problems


def published_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoint directories, newest first (staging directories excluded)."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            match = _PUBLISHED.fullmatch(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def beyond_retention(published: list[tuple[int, Path]], keep_last: int) -> list[Path]:
    """Directories to delete so that `keep_last` newest remain (`published` newest first)."""
    return [path for _, path in published[keep_last:]]
