"""The agent's tmpfs folder for in-memory snapshots (slurmft.train.snapshot), held for the agent's
life, and the sweep of folders whose agent died without removing its own.

A snapshot folder holds as much RAM as the training state, until the node reboots: an agent
that ends removes its folder, but one SIGKILLed (the OOM killer, `scancel --signal=KILL`, a
kill of its step) cannot. So every agent holds an exclusive `flock` on a lock file inside its
folder for its whole life (the kernel drops it when the process dies, however it dies), and at
its start removes its user's folders whose lock nobody holds.

The lock is taken before the folder has its name: the folder is made under a hidden name, locked,
then renamed into place, so a sweeping agent never sees a live folder without its lock. A
folder without a lock file at all (made by hand, or by an agent of a version before the lock)
is removed only once nothing touched it for `LOCKLESS_AFTER_S`. Only folders the user owns are
touched, never through a symbolic link.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".owner"
LOCKLESS_AFTER_S = 600.0


def folder_prefix(uid: int) -> str:
    return f"slurmft-{uid}-"


class SnapshotDirBusy(RuntimeError):
    """Another live agent holds the folder this agent was to use."""


class HeldSnapshotDir:
    """The folder, made and locked on `acquire`, removed on `release`."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> Path:
        # Left by an agent of this work dir that died (an earlier step of the job on this node).
        uid = os.getuid()
        if self.path.exists() and not _remove_if_orphan(self.path, uid, force_lockless=True):
            raise SnapshotDirBusy(f"{self.path} is held by a live agent, or not this user's")
        hidden = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}")
        hidden.mkdir(mode=0o700)
        fd = os.open(hidden / LOCK_NAME, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        hidden.rename(self.path)
        self._fd = fd
        return self.path

    def release(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sweep_orphans(parent: Path, uid: int, *, keep: Path | None = None) -> list[Path]:
    """Remove the folders of ``uid``'s agents that died without removing theirs; returns them."""
    removed = []
    for path in sorted(parent.glob(folder_prefix(uid) + "*")):
        if path == keep:
            continue
        try:
            if _remove_if_orphan(path, uid):
                removed.append(path)
        except OSError as error:  # gone meanwhile, or not ours to read: leave it
            log.debug("snapshot folder %s left: %s", path, error)
    return removed


def _remove_if_orphan(path: Path, uid: int, *, force_lockless: bool = False) -> bool:
    """Remove ``path`` when it is ``uid``'s folder and no live agent holds it."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        return False
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        idle_s = time.time() - info.st_mtime
        if force_lockless or idle_s >= LOCKLESS_AFTER_S:
            shutil.rmtree(path, ignore_errors=True)
            return True
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its agent lives
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
