"""Python stack dumps on a signal, written where the node agent collects them as evidence.

The agent sends SIGUSR2 to a rank it suspects of hanging (its phase is overdue) and then reads
`<dir>/stacks-rank<R>-pid<P>.txt`. faulthandler writes from the signal handler in C, so the dump
works even when the main thread is stuck in a collective that holds the GIL elsewhere.

A stopped rank (SIGSTOP, a frozen cgroup) runs no handler until it is continued, and once
continued it would go on training until the kill that follows: it might end a step after the hang
was declared, and that step would then be lost to the restart anyway. Such a rank gets
``DUMP_AND_EXIT_SIGNAL`` instead: faulthandler dumps, then chains to the signal's default action,
which ends the process before any of its Python code runs again.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
from pathlib import Path
from typing import IO

STACKS_DIR_ENV = "SLURMFT_STACKS_DIR"
DEFAULT_SIGNAL = signal.SIGUSR2
# A real-time signal: no Python, torch or Lightning code claims it, and its default action
# terminates without a core dump (a GPU process's core can be hundreds of GiB).
DUMP_AND_EXIT_SIGNAL = signal.SIGRTMIN + 10

# faulthandler keeps only the file descriptor: the file object must outlive the registration.
_open_files: list[IO[str]] = []


def stacks_dir() -> Path:
    """`$SLURMFT_STACKS_DIR`, else a directory in node-local tmp."""
    configured = os.environ.get(STACKS_DIR_ENV)
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "slurmft-stacks"


def stack_file_path(rank: int, pid: int | None = None, directory: Path | None = None) -> Path:
    pid = os.getpid() if pid is None else pid
    return (directory or stacks_dir()) / f"stacks-rank{rank}-pid{pid}.txt"


def install_stack_dump(
    rank: int, signum: int = DEFAULT_SIGNAL, directory: Path | None = None
) -> Path:
    """Dump all threads' stacks to the rank's file on `signum` and on a fatal error, and on
    ``DUMP_AND_EXIT_SIGNAL``, then exit by it."""
    path = stack_file_path(rank, directory=directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = path.open("a", buffering=1)
    _open_files.append(stream)
    faulthandler.register(signum, file=stream, all_threads=True, chain=False)
    # chain: once the dump is written, the previous disposition (default: terminate) is restored
    # and the signal raised again, from within the handler.
    faulthandler.register(DUMP_AND_EXIT_SIGNAL, file=stream, all_threads=True, chain=True)
    faulthandler.enable(file=stream, all_threads=True)
    return path
