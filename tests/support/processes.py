"""Training processes found from outside, as the tests and benchmarks look for them on this one
host: by command line and environment in /proc.

A worker started warm was forked by its node's zygote (slurmft.agent.zygote, named
`slurmft-zygote`), which was forked by the launcher: its command line is the launcher's, and
/proc shows the launcher's environment (no RANK), so the one it runs with is read from the
zygote's registry (`warm_environ`). The launcher, the zygote and the warm-start clients torchrun
runs name the script too, but train nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from slurmft.agent.procs import descendants, signal_pids
from slurmft.agent.zygote import PROCESS_NAME, warm_environ
from slurmft.train.stacks import STACKS_DIR_ENV


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def name_of(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")


def is_worker(pid: int, argv: list[str], script: str) -> bool:
    """Whether the process trains `script` (a path or module): a cold worker runs it itself
    (`python [-u] [-m] SCRIPT`); a warm one is a zygote's child, with the launcher's argv. The
    agent, the launcher, the zygote and the warm-start clients name the script further on."""
    if name_of(parent_of(pid)) == PROCESS_NAME:
        return script in argv
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


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (SigCgt in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def describe(pid: int) -> str:
    """One line: pid, state, the kernel function it sleeps in, and its command line."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
        return f"{pid} {stat[stat.rindex(')') + 2]} {wchan} {' '.join(argv_of(pid))[:160]}"
    except OSError:
        return f"{pid} (gone)"


def _stack_signal(pid: int) -> signal.Signals | None:
    """The signal that makes the process write its Python stacks: SIGUSR2 where slurmft.train's
    dump is installed (the rank goes on), else SIGABRT where faulthandler is on (it ends)."""
    return next((s for s in (signal.SIGUSR2, signal.SIGABRT) if catches(pid, s)), None)


def run_dumping_stacks_on_overrun(
    argv: list[str], *, timeout_s: float, stacks_dir: Path, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end, output captured. One that overruns ``timeout_s`` fails the test
    with what it was doing: its processes (state, kernel wait), every Python stack in it, and
    its output's tail, then is killed.

    The stacks come from faulthandler: a process that installed slurmft.train's dump (SIGUSR2,
    into ``stacks_dir``) writes it and goes on; any other Python process (the launcher) runs
    with PYTHONFAULTHANDLER and writes its stack to stderr on the SIGABRT that ends it."""
    stacks_dir.mkdir(parents=True, exist_ok=True)
    env = {**env, "PYTHONFAULTHANDLER": "1", STACKS_DIR_ENV: str(stacks_dir)}
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(argv, process.returncode, output, "")
    except subprocess.TimeoutExpired:
        pass
    tree = [process.pid, *descendants(process.pid)]
    report = [f"overran {timeout_s:.0f} s: {' '.join(argv)[:200]}", *map(describe, tree)]
    for signum in (signal.SIGUSR2, signal.SIGABRT):
        for pid in reversed(tree):  # children first: a launcher's end would take theirs along
            with contextlib.suppress(OSError):
                if _stack_signal(pid) == signum:
                    os.kill(pid, signum)
        time.sleep(2.0)  # faulthandler writes at once; this is for a busy machine to get to it
    # Each by pid: torchrun starts its workers in sessions of their own, and they hold the pipe.
    signal_pids([*tree, *descendants(process.pid)], signal.SIGKILL)
    output, _ = process.communicate(timeout=30)
    for dump in sorted(stacks_dir.glob("stacks-*.txt")):
        report += [f"--- {dump.name}", dump.read_text()[-6000:]]
    raise AssertionError("\n".join([*report, "--- output", output[-8000:]]))
