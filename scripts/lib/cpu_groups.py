"""cpu cgroups with a weight, for `scripts/test`: the serial group runs beside the parallel
phase (SLURMFT_TEST_SERIAL_BESIDE=1), each phase in a group of its own, the serial group's
weight far above the parallel phase's. When both want the CPU the serial group gets nearly all
of it, so its time bounds see the machine almost as if alone; the parallel phase still gets a
share and is never starved outright (`cpu.idle` did starve it: docs/testing.md).

    cpu_groups.py up NAME SHARES   make the group (SHARES as cgroup v1's cpu.shares, 1024 the
                                   default; v2's cpu.weight is scaled from it) and print its
                                   directory; exit 1, and why, where this user cannot
    cpu_groups.py down DIR         remove it; processes still in it go to its parent first

A process joins with `echo $BASHPID > DIR/cgroup.procs` (then exec); its children stay in.
Within a group the kernel's autogroups no longer apply, so each phase is one entity to the
scheduler however many sessions its processes make.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

CGROUP_FS = Path(os.environ.get("SLURMFT_CGROUP_FS", "/sys/fs/cgroup"))
V1_DEFAULT_SHARES = 1024
V2_DEFAULT_WEIGHT = 100


class Unavailable(Exception):
    """This machine (or this user) cannot make a weighted cpu cgroup; the message says why."""


def cpu_controller(fs: Path | None = None) -> Path:
    """The directory new cpu cgroups are made in: v1's cpu hierarchy, or v2's root."""
    fs = fs or CGROUP_FS
    v1 = fs / "cpu"
    if (v1 / "cgroup.procs").exists():
        return v1
    controllers = fs / "cgroup.controllers"
    if controllers.exists():
        if "cpu" in controllers.read_text().split():
            return fs
        raise Unavailable(f"cgroup v2 at {fs} has no cpu controller ({controllers})")
    raise Unavailable(f"no cpu cgroup controller under {fs}")


def weight_file(base: Path, shares: int) -> tuple[str, str]:
    """The file that sets a group's weight under ``base``, and its value for ``shares``."""
    if (base / "cgroup.controllers").exists():  # v2: 1-10000, 100 the default
        weight = round(shares * V2_DEFAULT_WEIGHT / V1_DEFAULT_SHARES)
        return "cpu.weight", str(min(max(weight, 1), 10000))
    return "cpu.shares", str(min(max(shares, 2), 262144))


def up(name: str, shares: int, fs: Path | None = None) -> Path:
    base = cpu_controller(fs)
    if (base / "cgroup.controllers").exists():
        # v2: a child gets the cpu controller only when its parent hands it down.
        _write(base / "cgroup.subtree_control", "+cpu")
    group = base / name
    try:
        group.mkdir()
    except OSError as error:
        raise Unavailable(f"cannot make the cgroup {group}: {error.strerror}") from error
    try:
        _write(group / weight_file(base, shares)[0], weight_file(base, shares)[1])
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
    try:
        if len(argv) == 3 and argv[0] == "up":
            print(up(argv[1], int(argv[2])))
        elif len(argv) == 2 and argv[0] == "down":
            left = down(Path(argv[1]))
            if left:
                print(f"{argv[1]}: processes {left} were still in it", file=sys.stderr)
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Unavailable as why:
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
