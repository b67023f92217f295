"""The one seam between slurmft and the Slurm commands: `run(argv, timeout)`.

Always an argv list, never a shell, so no string from a user is ever parsed by a shell here.
Fakes in the tests implement the same Runner protocol and replay recorded real output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurmft.config import SlurmSection
from slurmft.slurm.api import SlurmTimeout, SlurmUnreachable

DEFAULT_TIMEOUT_S = SlurmSection.command_timeout_s


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Runner(Protocol):
    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult: ...


class SubprocessRunner:
    """Runs Slurm commands as child processes. `env` (e.g. SLURM_CONF) is added to the caller's
    environment, or is the whole of it without `inherit`; counts are kept per command so load
    on slurmctld is visible. `stop` ends the commands in flight and refuses new ones."""

    def __init__(self, env: Mapping[str, str] | None = None, *, inherit: bool = True) -> None:
        self._env = dict(env or {}) if env or not inherit else None
        self._inherit = inherit
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self._stopped_because = ""

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        argv = tuple(argv)
        self.calls[argv[0]] = self.calls.get(argv[0], 0) + 1
        child = self._start(argv, piped_stdin=stdin is not None)
        try:
            stdout, stderr = child.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            _kill(child)
            child.communicate()
            raise SlurmTimeout(
                f"{argv[0]} did not answer within {timeout:g} s (slurmctld busy or hung?)",
                argv=argv,
            ) from error
        except BaseException:  # Ctrl-C: its own process group no longer gets the terminal's
            _kill(child)
            raise
        finally:
            with self._lock:
                self._running.discard(child)
        if self._stopped_because and child.returncode < 0:
            raise SlurmUnreachable(f"{argv[0]} ended early: {self._stopped_because}", argv=argv)
        return CommandResult(argv, child.returncode, stdout, stderr)

    def stop(self, reason: str) -> None:
        """Kill the commands in flight and refuse the next (the daemon stopping: a command
        waiting on a busy slurmctld would hold the stop for its whole timeout). Each caller gets
        SlurmUnreachable with `reason`; what it was doing is decided again from Slurm's view."""
        with self._lock:
            self._stopped_because = reason
            running = list(self._running)
        for child in running:
            _kill(child)

    def _start(self, argv: tuple[str, ...], *, piped_stdin: bool) -> subprocess.Popen[str]:
        # Under the lock: a command started while `stop` runs is either refused or killed.
        with self._lock:
            if self._stopped_because:
                raise SlurmUnreachable(f"{argv[0]} not run: {self._stopped_because}", argv=argv)
            try:
                child = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE if piped_stdin else None,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=self._merged_env(),
                    process_group=0,  # a wrapper's children die with it (_kill)
                )
            except FileNotFoundError as error:
                raise SlurmUnreachable(
                    f"{argv[0]} is not installed or not on PATH", argv=argv
                ) from error
            self._running.add(child)
            return child

    def _merged_env(self) -> dict[str, str] | None:
        if self._env is None:
            return None
        return {**os.environ, **self._env} if self._inherit else dict(self._env)


def _kill(child: subprocess.Popen[str]) -> None:
    """The command and whatever it started (a site's wrapper script around the real one):
    a grandchild left alive would hold the output pipes open, and the caller with them. Only
    while the command is not reaped: until then its pid, the group's id, cannot be reused."""
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
