"""Python stack dumps on a signal, written where the node agent collects them as evidence.

The agent sends SIGUSR2 to a rank it suspects of hanging (its phase is overdue) and then reads
`<dir>/stacks-rank<R>-pid<P>.txt`. faulthandler writes from the signal handler in C, so the dump
works even when the main thread is stuck in a collective that holds the GIL elsewhere.
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
    """Dump all threads' stacks to the rank's file on `signum` and on a fatal error."""
    path = stack_file_path(rank, directory=directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = path.open("a", buffering=1)
    _open_files.append(stream)
    faulthandler.register(signum, file=stream, all_threads=True, chain=False)
    faulthandler.enable(file=stream, all_threads=True)
    return path
