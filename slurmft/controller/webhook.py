"""The "a person is needed" webhook: notices from the store's outbox, POSTed as JSON.

The executor writes every notice as a ``notify`` action row, left ``planned`` when a webhook is
configured (act.py). This job sends them oldest first and marks each ``done`` once the receiver
took it, so a receiver that is down, or a daemon restart, delays notices but loses none. A
receiver that answers 4xx refuses the message itself (a wrong URL, a revoked hook): that notice
is marked ``failed`` with the answer and the next one is tried; anything else (no connection, a
timeout, 5xx, 408, 429) is retried on the next run of the job, in order.

The body carries ``text`` (what Slack- and Mattermost-style incoming webhooks show) beside the
structured fields, so the common chat receivers work without an adapter.
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus
from slurmft.db.records import finish_action
from slurmft.version import version

log = logging.getLogger(__name__)

BATCH = 20  # notices per run of the job: a backlog drains over a few runs
_RETRYABLE_4XX = frozenset({408, 429})


class WebhookError(Exception):
    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


Post = Callable[[str, dict[str, Any], float], None]


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> None:
    """POST ``body`` as JSON; raises WebhookError (``permanent`` for a 4xx refusal)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "User-Agent": f"slurmft/{version()}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        permanent = 400 <= exc.code < 500 and exc.code not in _RETRYABLE_4XX
        raise WebhookError(f"HTTP {exc.code} {exc.reason}", permanent=permanent) from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise WebhookError(f"no answer: {reason}") from None


def notice_body(action: Action, *, host: str) -> dict[str, Any]:
    run = f" (run {action.run_id})" if action.run_id else ""
    return {
        "text": f"slurmft on {host}: a person is needed{run}: {action.reason}",
        "kind": "slurmft.human_needed",
        "host": host,
        "run_id": action.run_id,
        "reason": action.reason,
        "at": action.created_at.isoformat(),
        "action_id": action.id,
    }


class WebhookOutbox:
    def __init__(
        self, database: Database, url: str, timeout_s: float, *, post: Post = post_json
    ) -> None:
        self._db = database
        self._url = url
        self._timeout_s = timeout_s
        self._post = post
        self._host = socket.gethostname()

    def deliver(self) -> int:
        """Send what waits in the outbox, oldest first; returns how many were delivered."""
        delivered = 0
        with self._db.session() as session:
            waiting = session.scalars(
                select(Action)
                .where(Action.kind == ActionKind.NOTIFY, Action.status == ActionStatus.PLANNED)
                .order_by(Action.id)
                .limit(BATCH)
            ).all()
            for notice in waiting:
                try:
                    self._post(self._url, notice_body(notice, host=self._host), self._timeout_s)
                except WebhookError as exc:
                    if not exc.permanent:
                        notice.error = f"webhook: {exc}; retrying"
                        log.warning("webhook %s: %s; will retry", self._url, exc)
                        break  # the receiver is away: keep the order, try again next run
                    finish_action(notice, ActionStatus.FAILED, error=f"webhook refused: {exc}")
                    log.error("webhook %s refused notice %d: %s", self._url, notice.id, exc)
                    continue
                finish_action(notice, ActionStatus.DONE)
                delivered += 1
        return delivered
