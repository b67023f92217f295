"""Process trees on Linux, read from /proc: torchrun starts each worker in a new session, so
killing torchrun's process group misses the workers; walking the parent links finds them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from errno import EPERM, ESRCH
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)


def parent_pids() -> dict[int, int]:
    """pid -> parent pid for every process visible in /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in parent_pids().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = children.get(frontier.pop(0), [])
        found += nxt
        frontier += nxt
    return found


def signal_pids(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def signal_main_threads(pids: list[int], signum: int) -> None:
    """Signal each process's main thread itself (tgkill), not the process: a signal sent to the
    process goes to whichever of its threads takes it first, and the others go on meanwhile."""
    for pid in pids:
        # glibc's tgkill(tgid, tid, sig); the main thread's id is the process's.
        if _libc.tgkill(pid, pid, signum) != 0 and ctypes.get_errno() not in (ESRCH, EPERM):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM, expected_parent: int | None = None) -> None:
    """Have the kernel send `signum` to this process when its parent exits (prctl
    PR_SET_PDEATHSIG), or send it now if the parent (`expected_parent`, else the current one)
    is gone already. Not Linux: no such guard."""
    parent = os.getppid() if expected_parent is None else expected_parent
    try:
        _libc.prctl(_PR_SET_PDEATHSIG, signum)
    except AttributeError:
        return
    if os.getppid() != parent:  # the parent died before the guard was set
        os.kill(os.getpid(), signum)


def kill_tree(pid: int, signum: int = signal.SIGKILL) -> list[int]:
    """Signal `pid` and all its descendants (collected first, so none is re-parented away)."""
    pids = [pid, *descendants(pid)]
    signal_pids(pids, signum)
    return pids


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited
