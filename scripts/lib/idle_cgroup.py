"""A cpu cgroup of idle priority for `scripts/test`: the parallel phase runs in one, so the serial
group can run beside it and still find the CPU as if it were alone.

A cgroup with `cpu.idle` set (Linux 5.15+, cgroup v1's cpu controller or v2's) is scheduled
like SCHED_IDLE: its processes run only on CPU that nothing outside it wants, and a waking
process outside it preempts them at once. Measured on the two-core test machine: a busy loop
took 0.210 s alone, 0.224 s beside four spinning processes in such a group, and 0.653 s beside
the same four at its own priority; its 1 ms sleeps overshot by at most 0.09 ms against 8.4 ms.

    idle_cgroup.py up NAME    print the new group's directory (exit 1, and why, when the
                              machine has no cpu controller this user can write)
    idle_cgroup.py down DIR   remove it; processes still in it go to its parent first

A process joins with `echo $BASHPID > DIR/cgroup.procs` (then exec); its children stay in.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

CGROUP_FS = Path(os.environ.get("SLURMFT_CGROUP_FS", "/sys/fs/cgroup"))


class Unavailable(Exception):
    """This machine (or this user) cannot make an idle cpu cgroup; the message says why."""


def cpu_controller(fs: Path = CGROUP_FS) -> Path:
    """The directory new cpu cgroups are made in: v1's cpu hierarchy, or v2's root."""
    v1 = fs / "cpu"
    if (v1 / "cgroup.procs").exists():
        return v1
    controllers = fs / "cgroup.controllers"
    if controllers.exists():
        if "cpu" in controllers.read_text().split():
            return fs
        raise Unavailable(f"cgroup v2 at {fs} has no cpu controller ({controllers})")
    raise Unavailable(f"no cpu cgroup controller under {fs}")


def up(name: str, fs: Path = CGROUP_FS) -> Path:
    base = cpu_controller(fs)
    if base == fs:  # v2: a child gets the cpu controller only when its parent hands it down
        _write(base / "cgroup.subtree_control", "+cpu")
    group = base / name
    try:
        group.mkdir()
    except OSError as error:
        raise Unavailable(f"cannot make the cgroup {group}: {error.strerror}") from error
    try:
        _write(group / "cpu.idle", "1")
    except Unavailable:
        group.rmdir()
        raise
    return group


def down(group: Path) -> list[int]:
    """Remove the group; the processes still in it (returned) move to its parent."""
    if not group.exists():
        return []
    left = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    for pid in left:
        with contextlib.suppress(Unavailable):  # it exited meanwhile
            _write(group.parent / "cgroup.procs", str(pid))
    try:
        group.rmdir()
    except OSError as error:
        raise Unavailable(f"cannot remove the cgroup {group}: {error.strerror}") from error
    return left


def _write(path: Path, value: str) -> None:
    try:
        with path.open("w") as file:
            file.write(value)
    except OSError as error:
        raise Unavailable(f"cannot write {value!r} to {path}: {error.strerror}") from error


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__, file=sys.stderr)
        return 2
    command, arg = argv
    try:
        if command == "up":
            print(up(arg))
        else:
            left = down(Path(arg))
            if left:
                print(f"{arg}: processes {left} were still in it", file=sys.stderr)
    except Unavailable as why:
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
