"""Python stacks of hung workers, saved before they are killed.

The training library installs a faulthandler dump on SIGUSR2 (slurmft.train.stacks): it writes
from C inside the signal handler, so it works while the main thread is stuck in a collective.
The agent signals each worker, waits until its stack file stops growing, and keeps the text.

A stopped worker (SIGSTOP, a frozen cgroup) cannot run any handler: a signal stays pending until
the process is continued. Continued to dump, it would train on until the kill that follows, and
a step it ended after its hang was declared would be lost to the restart all the same (seen: a
frozen rank ended one more step in the half second of the dump, and the run's step log showed
two outages for one hang). So such a worker gets the dump-and-exit signal at its main thread
(where training runs), then SIGCONT: the kernel delivers the pending signal as that thread
resumes, before it goes on with its own code, so the stacks show where it was stopped, and the
handler ends the process once they are written. Sent to the process instead, the signal goes to
whichever thread takes it first, and the main thread may run on meanwhile (seen in one try of
four). SIGCONT first would let it run on before the dump.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from slurmft.agent.procs import signal_main_threads, signal_pids
from slurmft.config import AgentSection
from slurmft.train.stacks import DEFAULT_SIGNAL, DUMP_AND_EXIT_SIGNAL, stack_file_path

# How much of each dump goes into the event; the whole file stays in the stacks directory.
EVENT_TEXT_LIMIT = 8_000


@dataclass(frozen=True)
class StackDump:
    rank: int
    pid: int
    path: Path
    text: str  # what this dump added to the file; empty if the worker never answered


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def dump_stacks(
    pids_by_rank: dict[int, int],
    stacks_dir: Path,
    wait_s: float = AgentSection.stack_dump_wait_s,
    settle_s: float = 0.2,
) -> list[StackDump]:
    """Ask every worker for its stacks; returns within about `wait_s`. A stopped worker exits
    once its stacks are written (see the module's docstring)."""
    paths = {rank: stack_file_path(rank, pid, stacks_dir) for rank, pid in pids_by_rank.items()}
    before = {rank: _size(path) for rank, path in paths.items()}
    pids = list(pids_by_rank.values())
    stopped = [pid for pid in pids if is_stopped(pid)]
    signal_pids([pid for pid in pids if pid not in stopped], DEFAULT_SIGNAL)
    # To the main thread, where training runs: it takes the signal the moment it resumes.
    signal_main_threads(stopped, DUMP_AND_EXIT_SIGNAL)
    # The dump signal first, then continue.
    signal_pids(stopped, signal.SIGCONT)
    deadline = time.monotonic() + wait_s
    last = dict(before)
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = {rank: _size(path) for rank, path in paths.items()}
        if now != last:
            last, stable_since = now, time.monotonic()
        elif all(now[r] > before[r] for r in now) and time.monotonic() - stable_since >= settle_s:
            break
    dumps = []
    for rank, path in paths.items():
        text = ""
        if last[rank] > before[rank]:
            with path.open("rb") as stream:
                stream.seek(before[rank])
                text = stream.read().decode(errors="replace")
        dumps.append(StackDump(rank, pids_by_rank[rank], path, text))
    return dumps


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (state T); a tracer's stop (t) is the tracer's to end."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "T"


def ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
