"""Following runs from Python: `Run` (status, events, wait, cancel) and `runs`.

Every call asks the daemon over its unix socket, as `slurmft status | events | runs | cancel`
do; the daemon takes the caller's uid from the kernel and answers with the caller's own runs
only (an admin's: all).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurmft.api.records import EventPage, RunStatus, RunSummary, TimelineEntry
from slurmft.errors import SlurmftError

if TYPE_CHECKING:
    from slurmft.config import Config
    from slurmft.controller.spec import RunSpec

# Seconds `wait` keeps asking while the daemon is away (a restart of its service), before it
# gives up and raises what the socket said.
DAEMON_AWAY_S = 300.0


class WaitTimeout(SlurmftError, TimeoutError):
    """`Run.wait` gave up before the run ended; the run goes on."""


def _socket(config: Config | None) -> Path:
    from slurmft.config import load_config
    from slurmft.controller.rpc import SOCKET_NAME

    return (config or load_config()).runtime_dir / SOCKET_NAME


def _ask(socket_path: Path, op: str, **args: Any) -> Any:
    # The socket client is loaded by a call that asks, not by `import slurmft`.
    from slurmft.controller.rpc import call

    return call(socket_path, op, **args)


class Run:
    """A run the daemon knows: one just submitted (`slurmft.submit`) or any of yours by id."""

    def __init__(
        self,
        run_id: str,
        *,
        job_id: str | None = None,
        spec: RunSpec | None = None,
        config: Config | None = None,
    ) -> None:
        self.run_id = run_id
        self.job_id = job_id  # the Slurm job it was submitted as (a requeue keeps it)
        self.spec = spec  # as submitted (spares fitted to the job's torch); None: found by id
        self._socket = _socket(config)

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, job_id={self.job_id!r})"

    def status(self) -> RunStatus:
        """Where the run is: `slurmft status RUN --json`, typed."""
        return RunStatus.from_dict(_ask(self._socket, "status", run_id=self.run_id))

    def events(self, limit: int = 100, *, after: Mapping[str, int] | None = None) -> EventPage:
        """The run's timeline: the newest ``limit`` entries, or with ``after`` (a page's
        ``cursor``) the first ``limit`` recorded since that page."""
        args: dict[str, Any] = {"run_id": self.run_id, "limit": limit}
        if after is not None:
            args["cursor"] = dict(after)
        return EventPage.from_dict(_ask(self._socket, "events", **args))

    def follow(self, limit: int = 100, *, interval_s: float = 1.0) -> Iterator[TimelineEntry]:
        """The newest ``limit`` entries, then each new one as it is recorded, until the run has
        ended (and one more ask after its end, so its final actions are seen)."""
        page = self.events(limit)
        yield from page.entries
        ended = False
        while True:
            ended_before = ended
            if not page.truncated:  # more is waiting: ask again at once
                time.sleep(interval_s)
            page = self.events(1000, after=page.cursor)
            yield from page.entries
            ended = page.state.is_terminal
            if ended and ended_before and not page.entries:
                return

    def wait(self, timeout_s: float | None = None, *, poll_s: float = 5.0) -> RunStatus:
        """Until the run has ended (completed, failed, cancelled or stopped); its final status.

        Raises WaitTimeout after ``timeout_s`` (the run goes on). A daemon that is away (its
        service restarting) is asked again for up to five minutes."""
        from slurmft.controller.rpc import DaemonUnreachable

        started = time.monotonic()
        away_since: float | None = None
        while True:
            try:
                status = self.status()
            except DaemonUnreachable:
                now = time.monotonic()
                away_since = away_since if away_since is not None else now
                if now - away_since > DAEMON_AWAY_S:
                    raise
            else:
                away_since = None
                if status.ended:
                    return status
            waited = time.monotonic() - started
            if timeout_s is not None and waited >= timeout_s:
                raise WaitTimeout(f"run {self.run_id} had not ended after {waited:.0f} s")
            left = poll_s if timeout_s is None else min(poll_s, timeout_s - waited)
            time.sleep(max(left, 0.0))

    def cancel(self) -> None:
        """Ask the daemon to cancel the run's Slurm job and end the run (`status` shows when
        it has ended; `wait` waits for it)."""
        _ask(self._socket, "cancel", run_id=self.run_id)

    def release(self) -> bool:
        """An admin's: let the daemon's control pass try this held run again (its part failed
        pass after pass; `status` says why). False when it was not held."""
        reply = _ask(self._socket, "release_run", run_id=self.run_id)
        return bool(reply["released"])


def runs(
    *,
    states: Iterable[str] = (),
    since: datetime | str | None = None,
    user: str | None = None,
    limit: int = 200,
    config: Config | None = None,
) -> list[RunSummary]:
    """Your runs, newest first (`slurmft runs --json`, typed). ``states``: only runs in these
    states; ``since``: created since this time (an aware datetime or ISO 8601 text); ``user``:
    only this user's runs (an admin's option; others see their own)."""
    args: dict[str, Any] = {"states": [str(state) for state in states], "limit": limit}
    if since is not None:
        args["since"] = since.isoformat() if isinstance(since, datetime) else since
    if user is not None:
        args["user"] = user
    return [RunSummary.from_dict(row) for row in _ask(_socket(config), "runs", **args)]
