"""A local request to save soon (time limit, preemption), turned into a coordinated save.

Any rank may see the request: a signal (SIGUSR1 by default, what `sbatch --signal=B:USR1@T` and
the agent send) or a newer modification time of `$SLURMFT_SAVE_REQUEST_FILE` (the agent touches
it; checking costs one stat per step). The ranks agree through the telemetry slot of the step's
gradient all-reduce (or `exchange_telemetry`), so every rank saves at the same step boundary: the
step after the request arrives, or within K steps with the K-step exchange.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

REQUEST_FILE_ENV = "SLURMFT_SAVE_REQUEST_FILE"


class SaveRequest:
    def __init__(self, request_file: str | None = None, signum: int | None = signal.SIGUSR1):
        configured = request_file if request_file is not None else os.environ.get(REQUEST_FILE_ENV)
        self.request_file = Path(configured) if configured else None
        self._flag = False
        self._handled_mtime = self._mtime()  # a request older than this process is stale
        if signum is not None:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._flag = True  # only set a flag: the save happens at the next step boundary

    def _mtime(self) -> float:
        if self.request_file is None:
            return 0.0
        try:
            return self.request_file.stat().st_mtime
        except OSError:
            return 0.0

    def request(self) -> None:
        self._flag = True

    def pending(self) -> bool:
        return self._flag or self._mtime() > self._handled_mtime

    def clear(self) -> None:
        """Call after the coordinated save (on every rank, whether or not it saw the request)."""
        self._flag = False
        self._handled_mtime = max(self._handled_mtime, self._mtime())
