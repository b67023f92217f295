"""The "a person is needed" webhook: notices from the store's outbox to a real HTTP receiver.

The receiver is a local http.server that records what it gets and answers what the test says;
the store is SQLite and PostgreSQL (the `database` fixture).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from slurmft.config import load_config
from slurmft.controller import views as v
from slurmft.controller.act import Executor
from slurmft.controller.daemon import Daemon
from slurmft.controller.webhook import WebhookOutbox
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus


class Receiver:
    """A webhook receiver on 127.0.0.1: records JSON bodies, answers with `status`."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                if receiver.status == 200:
                    receiver.bodies.append(body)
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    served = Receiver()
    yield served
    served.close()


@pytest.fixture
def run_id(database: Database, seed_run: Callable[..., None]) -> str:
    seed_run(database, "r1")
    return "r1"


def _notify(database: Database, run_id: str, *reasons: str) -> None:
    Executor(database, slurm=None, webhook=True).execute(  # type: ignore[arg-type]
        [v.NotifyHuman(run_id, reason) for reason in reasons]
    )


def _notices(database: Database) -> list[tuple[str, ActionStatus, str | None]]:
    with database.session() as s:
        rows = s.scalars(
            select(Action).where(Action.kind == ActionKind.NOTIFY).order_by(Action.id)
        ).all()
        return [(a.reason, a.status, a.error) for a in rows]


def test_notices_are_delivered_in_order_with_a_chat_readable_text(
    database: Database, run_id: str, receiver: Receiver
) -> None:
    _notify(database, run_id, "run r1 stopped: crash loop", "spares exhausted: requeueing")
    assert WebhookOutbox(database, receiver.url, 5.0).deliver() == 2
    assert [b["reason"] for b in receiver.bodies] == [
        "run r1 stopped: crash loop",
        "spares exhausted: requeueing",
    ]
    first = receiver.bodies[0]
    assert (first["kind"], first["run_id"]) == ("slurmft.human_needed", "r1")
    assert "a person is needed (run r1): run r1 stopped: crash loop" in first["text"]
    assert {status for _, status, _ in _notices(database)} == {ActionStatus.DONE}
    assert WebhookOutbox(database, receiver.url, 5.0).deliver() == 0  # each is sent once


def test_a_receiver_that_is_away_delays_notices_and_loses_none(
    database: Database, run_id: str, receiver: Receiver
) -> None:
    _notify(database, run_id, "first", "second")
    receiver.status = 503
    assert WebhookOutbox(database, receiver.url, 5.0).deliver() == 0
    notices = _notices(database)
    assert [status for _, status, _ in notices] == [ActionStatus.PLANNED] * 2
    assert notices[0][2] == "webhook: HTTP 503 Service Unavailable; retrying"

    dead = Receiver()
    dead.close()  # nothing listens on its port any more
    assert WebhookOutbox(database, dead.url, 1.0).deliver() == 0
    assert (_notices(database)[0][2] or "").startswith("webhook: no answer")

    receiver.status = 200
    assert WebhookOutbox(database, receiver.url, 5.0).deliver() == 2
    assert [b["reason"] for b in receiver.bodies] == ["first", "second"]


def test_a_refused_notice_is_marked_failed_and_the_next_one_still_goes(
    database: Database, run_id: str, receiver: Receiver
) -> None:
    _notify(database, run_id, "refused")
    receiver.status = 404
    WebhookOutbox(database, receiver.url, 5.0).deliver()
    _notify(database, run_id, "accepted")
    receiver.status = 200
    assert WebhookOutbox(database, receiver.url, 5.0).deliver() == 1
    assert _notices(database) == [
        ("refused", ActionStatus.FAILED, "webhook refused: HTTP 404 Not Found"),
        ("accepted", ActionStatus.DONE, None),
    ]
    assert [b["reason"] for b in receiver.bodies] == ["accepted"]


def test_the_daemon_sends_what_its_policy_flags(tmp_path: Path, receiver: Receiver) -> None:
    config = load_config(
        environ={},
        system_file=tmp_path / "absent.toml",
        overrides=[
            f"paths.state_dir={tmp_path / 'state'}",
            f"paths.runtime_dir={tmp_path / 'run'}",
            f"notify.webhook_url={receiver.url}",
        ],
    )
    database = Database(config.database_url)
    database.upgrade()
    daemon = Daemon(config, database=database, slurm=None)  # type: ignore[arg-type]
    daemon.executor.execute([v.NotifyHuman(None, "drain of n2 refused by the rate limits")])
    daemon.webhook_pass()
    assert [b["reason"] for b in receiver.bodies] == ["drain of n2 refused by the rate limits"]
    database.dispose()
