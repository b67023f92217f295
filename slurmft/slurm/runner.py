"""The one seam between slurmft and the Slurm commands: `run(argv, timeout)`.

Always an argv list, never a shell, so no string from a user is ever parsed by a shell here.
Fakes in the tests implement the same Runner protocol and replay recorded real output.
"""

from __future__ import annotations

import os
import subprocess
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
    on slurmctld is visible."""

    def __init__(self, env: Mapping[str, str] | None = None, *, inherit: bool = True) -> None:
        self._env = dict(env or {}) if env or not inherit else None
        self._inherit = inherit
        self.calls: dict[str, int] = {}

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        argv = tuple(argv)
        self.calls[argv[0]] = self.calls.get(argv[0], 0) + 1
        try:
            completed = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env=self._merged_env(),
            )
        except subprocess.TimeoutExpired as error:
            raise SlurmTimeout(
                f"{argv[0]} did not answer within {timeout:g} s (slurmctld busy or hung?)",
                argv=argv,
            ) from error
        except FileNotFoundError as error:
            raise SlurmUnreachable(
                f"{argv[0]} is not installed or not on PATH", argv=argv
            ) from error
        return CommandResult(argv, completed.returncode, completed.stdout, completed.stderr)

    def _merged_env(self) -> dict[str, str] | None:
        if self._env is None:
            return None
        return {**os.environ, **self._env} if self._inherit else dict(self._env)
