"""The daemon's HTTP endpoint for agents: bounded, authenticated, and never taken down by a
bad request.

stdlib's ThreadingHTTPServer is enough here: an agent sends one small batch a second, and the
store, not HTTP parsing, bounds the rate. So request threads only check and parse; one writer
stores the batches that arrive together in one transaction (controller.group_commit) and each
request is answered once its batch is committed. Every request is answered with JSON.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sqlalchemy.exc import IntegrityError

from slurmft.controller.group_commit import GroupCommitter
from slurmft.controller.ingest import RESTART_COMMAND_TTL, IngestRefused
from slurmft.controller.serving import ServerThread
from slurmft.db import Database, DatabaseUnavailable
from slurmft.protocol import (
    BATCH_PATH,
    CONTENT_TYPE,
    MAX_BODY_BYTES,
    TIME_PATH,
    AgentBatch,
    ProtocolError,
    TimeReply,
)

log = logging.getLogger(__name__)


class IngestServer:
    """Serves BATCH_PATH and TIME_PATH on ``host:port`` in a background thread."""

    def __init__(
        self,
        database: Database,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        sample_every: timedelta = timedelta(seconds=60),
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        observe: Callable[[int, float], None] | None = None,
        restart_ttl: timedelta = RESTART_COMMAND_TTL,
    ) -> None:
        self._committer = GroupCommitter(
            database, clock=clock, sample_every=sample_every, restart_ttl=restart_ttl
        )
        handler = type(
            "Handler",
            (_Handler,),
            {
                "committer": self._committer,
                "clock": staticmethod(clock),
                # Metrics hook: (HTTP status, seconds) of every batch POST.
                "observe": staticmethod(observe or _ignore),
            },
        )
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = ServerThread(self._server, "slurmft-ingest")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)  # an AF_INET address: (host, port)
        return f"http://{host}:{port}"

    def start(self) -> IngestServer:
        self._committer.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._thread.stop()
        self._committer.stop()


class _Handler(BaseHTTPRequestHandler):
    committer: GroupCommitter
    clock: Callable[[], datetime]
    observe: Callable[[int, float], None]
    server_version = "slurmft"
    _started = 0.0

    def log_message(self, format: str, *args: object) -> None:
        log.debug("ingest %s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        if self.path != TIME_PATH:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
            return
        self._reply(HTTPStatus.OK, TimeReply(server_time=self.clock().timestamp()).to_json())

    def do_POST(self) -> None:
        if self.path != BATCH_PATH:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
            return
        self._started = time.monotonic()
        self._answer_batch()

    def _answer_batch(self) -> None:
        try:
            self._reply(HTTPStatus.OK, self._ingest())
        except IngestRefused as exc:
            self._error(HTTPStatus(exc.status), str(exc))
        except ProtocolError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except (DatabaseUnavailable, IntegrityError) as exc:
            # The store is away, or a concurrent resend of the same batch won: retry later.
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"retry later: {type(exc).__name__}")
        except Exception:
            log.exception("ingest failed")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the daemon's log")

    def _ingest(self) -> bytes:
        token = _bearer(self.headers.get("Authorization", ""))
        if token is None:
            raise IngestRefused(401, "missing 'Authorization: Bearer <run token>'")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise IngestRefused(411, "Content-Length required")
        if int(length) > MAX_BODY_BYTES:
            raise IngestRefused(413, f"body of {length} bytes is over {MAX_BODY_BYTES}")
        batch = AgentBatch.from_json(self.rfile.read(int(length)))
        return self.committer.submit(batch, token).to_json()

    def _reply(self, status: HTTPStatus, body: bytes) -> None:
        if self.command == "POST" and self.path == BATCH_PATH:
            # Counted before the answer leaves: whoever got it then sees it on /metrics.
            self.observe(int(status), time.monotonic() - self._started)
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self.close_connection = True  # an unread body must never be parsed as the next request
        self._reply(status, json.dumps({"error": message}).encode())


def _ignore(_status: int, _seconds: float) -> None:
    pass


def _bearer(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
