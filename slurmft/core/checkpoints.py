"""Progress for any script: the newest *complete* checkpoint under a run's checkpoint path.

The one rule (docs/design.md, "Progress"), read the same way by the batch step, which scans the
folder, and by the daemon, which gets what it found as a `checkpoint` event:

- `slurmft`: a `step-<digits>/` folder (slurmft.train); complete when it exists (published by a
  rename);
- `dcp`: a folder holding `.metadata` or `*.distcp` (torch.distributed.checkpoint); complete when
  `.metadata` exists (written last);
- `hf`: a `checkpoint-<N>/` folder (Hugging Face Trainer); complete with `trainer_state.json`;
- `lightning`: a `*.ckpt` file, or folder (sharded strategies); complete when its size and mtime
  are the same at two polls;
- `file`: a `.pt`, `.pth`, `.bin`, `.safetensors` or `.pkl` file (torch.save); the same.

A file written in place cannot be told from one renamed into place, so plain files wait for a
second poll too. Never progress: anything under `.slurmft/` (the run's own state), hidden or
temporary names (`.x`, `x.tmp`, `x.partial`, `x~`, ...), a half-written folder of one of the
layouts above (never searched inside), and anything older than the newest seen before (a
rollback). When a `slurmft` checkpoint exists, the other layouts are ignored: the training
script reports verified progress itself. The scan follows no links and stops at MAX_DEPTH
levels and MAX_ENTRIES entries.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

MAX_DEPTH = 4
MAX_ENTRIES = 20_000
OWN_DIR = ".slurmft"
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".pkl")
TEMPORARY = re.compile(r"(\.tmp|\.temp|\.partial|\.incomplete|\.lock|~)$|\.tmp[.\d]", re.I)
SLURMFT_DIR = re.compile(r"step-\d+")
HF_DIR = re.compile(r"checkpoint-\d+")


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint: where (relative to the checkpoint path), its layout, and its
    place in time (`ordinal`: the step for `slurmft`, else its mtime in ns)."""

    path: str
    layout: str
    ordinal: int

    @property
    def label(self) -> str:
        """How it reads as the budget's progress (`RestartBudget.last_progress`)."""
        if self.layout == "slurmft":
            return f"step {self.ordinal}"  # = slurmft.core.budget.progress_label
        when = datetime.fromtimestamp(self.ordinal / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self.layout} {self.path} ({when})"


@dataclass(frozen=True)
class _Candidate:
    path: str
    layout: str
    signature: tuple[int, int]  # (size, mtime_ns): unchanged at two polls = complete
    ordinal: int
    needs_two_polls: bool


class CheckpointWatch:
    """Polls one checkpoint path; `poll` returns the newest complete checkpoint seen so far."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.newest: Checkpoint | None = None
        self._last_signatures: dict[str, tuple[int, int]] = {}

    def poll(self) -> Checkpoint | None:
        candidates = list(_scan(self.root))
        signatures = {c.path: c.signature for c in candidates}
        complete = [
            c
            for c in candidates
            if not c.needs_two_polls or self._last_signatures.get(c.path) == c.signature
        ]
        self._last_signatures = signatures
        own = [c for c in complete if c.layout == "slurmft"]
        best = max(own or complete, key=lambda c: (c.ordinal, c.path), default=None)
        if best is not None and self._is_newer(best):
            self.newest = Checkpoint(best.path, best.layout, best.ordinal)
        return self.newest

    def _is_newer(self, candidate: _Candidate) -> bool:
        seen = self.newest
        if seen is None:
            return True
        if (seen.layout == "slurmft") != (candidate.layout == "slurmft"):
            return candidate.layout == "slurmft"  # verified progress outranks file progress
        return (candidate.ordinal, candidate.path) > (seen.ordinal, seen.path)


def _scan(root: Path) -> Iterator[_Candidate]:
    budget = [MAX_ENTRIES]
    yield from _scan_dir(root, "", 0, budget)


def _entries(path: Path, budget: list[int]) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            entries = []
            for entry in it:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
                entries.append(entry)
            return entries
    except OSError:  # gone, or not readable: nothing seen there
        return []


def _scan_dir(path: Path, rel: str, depth: int, budget: list[int]) -> Iterator[_Candidate]:
    for entry in _entries(path, budget):
        name = entry.name
        if name.startswith(".") or name == OWN_DIR or TEMPORARY.search(name):
            continue
        child = f"{rel}{name}"
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = entry.is_file(follow_symlinks=False)
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if is_dir:
            found = _folder(Path(entry.path), child, stat, budget)
            if found is not None:
                if found.ordinal >= 0:
                    yield found
                continue  # a folder of a layout, complete or not, is never searched inside
            if depth + 1 < MAX_DEPTH:
                yield from _scan_dir(Path(entry.path), f"{child}/", depth + 1, budget)
        elif is_file and name.endswith((".ckpt", *FILE_SUFFIXES)):
            layout = "lightning" if name.endswith(".ckpt") else "file"
            signature = (stat.st_size, stat.st_mtime_ns)
            yield _Candidate(child, layout, signature, stat.st_mtime_ns, needs_two_polls=True)


def _folder(path: Path, rel: str, stat: os.stat_result, budget: list[int]) -> _Candidate | None:
    """The folder as a checkpoint of a layout (ordinal -1: of that layout, not complete), or
    None when it is no checkpoint of its own (an ordinary folder, searched inside)."""
    name = path.name
    if SLURMFT_DIR.fullmatch(name):
        step = int(name.removeprefix("step-"))
        return _Candidate(rel, "slurmft", (0, 0), step, needs_two_polls=False)
    if HF_DIR.fullmatch(name):
        return _marked(path, rel, "hf", "trainer_state.json")
    if name.endswith(".ckpt"):
        entries = [e for e in _entries(path, budget) if e.is_file(follow_symlinks=False)]
        stats = [e.stat(follow_symlinks=False) for e in entries]
        size = sum(s.st_size for s in stats)
        mtime = max((s.st_mtime_ns for s in stats), default=stat.st_mtime_ns)
        return _Candidate(rel, "lightning", (size, mtime), mtime, needs_two_polls=True)
    if (path / ".metadata").is_file() or any(p.suffix == ".distcp" for p in _files(path, budget)):
        return _marked(path, rel, "dcp", ".metadata")
    return None


def _files(path: Path, budget: list[int]) -> list[Path]:
    return [Path(e.path) for e in _entries(path, budget) if e.is_file(follow_symlinks=False)]


def _marked(path: Path, rel: str, layout: str, marker: str) -> _Candidate:
    try:
        mtime = os.lstat(path / marker).st_mtime_ns
    except OSError:
        return _Candidate(rel, layout, (0, 0), -1, needs_two_polls=False)  # not complete yet
    return _Candidate(rel, layout, (0, mtime), mtime, needs_two_polls=False)
