"""Requests the daemon's endpoints refused: a counter, a log line, and an audit row naming the
run or the user where one is known.

The servers refuse on their own threads (the selector's, a worker's) and must not wait on the
store for it, and a flood of refusals must not become a flood of rows: each refusal is counted
and logged at once, and queued; ``flush`` (a periodic job) writes one ``refuse_request`` action
per (endpoint, reason, run, user) with how many were refused since the last flush. Past
``MAX_QUEUED`` distinct keys, more are only counted and logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter

from slurmft.controller.bounded import Connection, RefusalLog
from slurmft.controller.http import Caller
from slurmft.core.kinds import ActionKind, ActionStatus
from slurmft.db import Database, DatabaseUnavailable
from slurmft.db.models import Action

log = logging.getLogger(__name__)

MAX_QUEUED = 1000


@dataclass(frozen=True)
class _Key:
    server: str
    reason: str
    run_id: str | None
    uid: int | None
    user: str | None


def _user_name(uid: int) -> str | None:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class Refusals:
    """Counts, logs and queues for the audit each refusal of the daemon's endpoints."""

    def __init__(
        self,
        database: Database,
        counter: Counter,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._database = database
        self._counter = counter
        self._clock = clock
        self._lock = threading.Lock()
        self._queued: dict[_Key, tuple[int, str]] = {}
        self._logs: dict[str, RefusalLog] = {}

    def _log(self, server: str) -> RefusalLog:
        with self._lock:
            if server not in self._logs:
                self._logs[server] = RefusalLog(server)
            return self._logs[server]

    def note(
        self,
        server: str,
        reason: str,
        message: str,
        *,
        run_id: str | None = None,
        uid: int | None = None,
        user: str | None = None,
    ) -> None:
        self._counter.labels(server, reason).inc()
        who = f"run {run_id} of {user}" if run_id else f"uid {uid}" if uid is not None else ""
        self._log(server)(reason, f"{who + ': ' if who else ''}{message}")
        if run_id is None and uid is None:
            return  # no one to name: the counter and the log line are the record
        key = _Key(server, reason, run_id, uid, user)
        with self._lock:
            count, _ = self._queued.get(key, (0, message))
            if count or len(self._queued) < MAX_QUEUED:
                self._queued[key] = (count + 1, message)

    # --- the hooks the servers call ------------------------------------------------------

    def connection_hook(self, server: str) -> Callable[[str, Connection], None]:
        """For a ``BoundedServer``: a connection refused before its request was read."""

        def hook(reason: str, conn: Connection) -> None:
            uid = conn.caller.get("uid")
            detail = conn.caller.get("detail")
            self.note(
                server,
                reason,
                f"from {_peer(conn.peer)}{f': {detail}' if detail else ''}",
                uid=uid,
                user=_user_name(uid) if uid is not None else None,
            )

        return hook

    def ingest_hook(self, reason: str, caller: Caller | None, message: str) -> None:
        """For the ingest handler: a request refused from its headers."""
        self.note(
            "ingest",
            reason,
            message,
            run_id=caller.run_id if caller else None,
            uid=caller.owner_uid if caller else None,
            user=caller.owner_name if caller else None,
        )

    # --- the audit -----------------------------------------------------------------------

    def flush(self) -> int:
        """Write the queued refusals as actions; returns how many rows were written."""
        with self._lock:
            queued, self._queued = self._queued, {}
        if not queued:
            return 0
        now = self._clock()
        try:
            with self._database.session() as session:
                for key, (count, message) in queued.items():
                    evidence: dict[str, Any] = {
                        "endpoint": key.server,
                        "reason": key.reason,
                        "count": count,
                        "uid": key.uid,
                        "user": key.user,
                    }
                    session.add(
                        Action(
                            run_id=key.run_id,
                            kind=ActionKind.REFUSE_REQUEST,
                            reason=f"{key.server} refused {count} request(s) ({key.reason}): "
                            f"{message}"[:2000],
                            evidence=evidence,
                            status=ActionStatus.DONE,
                            created_at=now,
                            finished_at=now,
                        )
                    )
        except DatabaseUnavailable as exc:
            log.warning("refusal audit not written (%d rows): %s", len(queued), exc)
            return 0
        return len(queued)


def _peer(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return "the local socket"
