"""Training processes found from outside, as the tests and benchmarks look for them on this one
host: by command line and environment in /proc.

A worker started warm was forked by its node's zygote (slurmft.agent.zygote): its command line
is the zygote's, and /proc shows the zygote's environment (no RANK), so the one it runs with is
read from the zygote's registry (`warm_environ`). The zygote itself and the warm-start clients
torchrun runs name the script too, but train nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from slurmft.agent.zygote import warm_environ

ZYGOTE = "slurmft.agent.zygote"


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def is_worker(pid: int, argv: list[str], script: str) -> bool:
    """Whether the process trains `script` (a path or module): a cold worker runs it itself
    (`python [-u] [-m] SCRIPT`); a warm one is its zygote's child, with the zygote's argv. The
    agent, the launcher, the zygote and the warm-start clients name the script further on."""
    if ZYGOTE in argv[1:4]:
        return script in argv and argv_of(parent_of(pid)) == argv
    return script in argv[1:4]


def environ_of(pid: int) -> set[bytes]:
    return set(warm_environ(pid).split(b"\0"))


def workers(script: str, names: bytes = b"") -> Iterator[tuple[int, list[str], set[bytes]]]:
    """Every process training `script` whose command line also holds `names` (a run's folder):
    pid, argv and the environment it runs with."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            raw = (entry / "cmdline").read_bytes()
            if names not in raw or script.encode() not in raw:
                continue
            argv = argv_of(pid)
            if is_worker(pid, argv, script):
                yield pid, argv, environ_of(pid)
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
