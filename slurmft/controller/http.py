"""The daemon's HTTP endpoint for agents: bounded, authenticated, and never taken down by a
bad request.

The connections are served by ``BoundedServer`` (controller.bounded): one selector thread reads
every request's head with a deadline, so idle and slow clients hold no thread (nor does an
agent's kept-alive connection between its posts: a connection per agent, not one per post), and
at most ``daemon.ingest_workers`` threads answer complete requests. A request's token is
checked from its headers, and its Content-Length bounded, before a byte of its body is read:
an unknown token is a 401 and its body is never read. Request threads only check and parse;
one writer stores the batches that arrive together in one transaction (controller.group_commit)
and each request is answered once its batch is committed. Every request is answered with JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http import HTTPStatus

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from slurmft.controller.bounded import (
    BoundedHTTPHandler,
    BoundedServer,
    Connection,
    HttpProtocol,
    ServerLimits,
    tcp_listener,
)
from slurmft.controller.group_commit import GroupCommitter
from slurmft.controller.ingest import RESTART_COMMAND_TTL, IngestRefused, hash_token
from slurmft.controller.limits import IngestLimiter, RateLimits
from slurmft.db import Database, DatabaseUnavailable
from slurmft.db.models import Run
from slurmft.protocol import (
    BATCH_PATH,
    CONTENT_TYPE,
    MAX_BODY_BYTES,
    TIME_PATH,
    AgentBatch,
    ItemsRefused,
    ProtocolError,
    TimeReply,
)

log = logging.getLogger(__name__)

# The defaults of daemon.ingest_* and daemon.*_timeout_s (slurmft.config), for tests and tools
# that build a server without a config.
DEFAULT_LIMITS = ServerLimits(
    max_connections=4096,
    workers=256,
    header_timeout_s=10.0,
    body_timeout_s=30.0,
    idle_timeout_s=5.0,
)
_DIGITS = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True)
class Caller:
    """Whose token a request carries, as far as the headers tell."""

    run_id: str
    owner_uid: int
    owner_name: str


# (reason, who where known, what the client was told): a refusal, for its metric, log line and
# audit row.
RefusalSink = Callable[[str, Caller | None, str], None]


class TokenBook:
    """Which run a bearer token belongs to, from the store, remembered for a while: the check
    made from the headers, before a body is read. The batch's own run is checked again, in
    constant time, when it is stored (controller.ingest)."""

    KNOWN_FOR_S = 60.0
    UNKNOWN_FOR_S = 2.0
    MAX_ENTRIES = 10_000

    def __init__(self, database: Database, clock: Callable[[], float] = time.monotonic) -> None:
        self._database = database
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, Caller | None]] = {}

    def caller(self, token: str) -> Caller | None:
        digest = hash_token(token)
        now = self._clock()
        with self._lock:
            entry = self._entries.get(digest)
        if entry is not None and entry[0] > now:
            return entry[1]
        with self._database.session() as session:
            row = session.execute(
                select(Run.id, Run.owner_uid, Run.owner_name).where(Run.token_hash == digest)
            ).first()
        caller = Caller(row[0], row[1], row[2]) if row is not None else None
        ttl = self.KNOWN_FOR_S if caller is not None else self.UNKNOWN_FOR_S
        with self._lock:
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()  # a flood of made-up tokens: start again, never grow
            self._entries[digest] = (now + ttl, caller)
        return caller


class _HeadRefused(IngestRefused):
    """A request refused from its headers, or for how its body arrived, before any parsing."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(status, message)
        self.reason = reason


def _no_sink(_reason: str, _caller: Caller | None, _message: str) -> None:
    pass


def server_tls(cert: str, key: str) -> ssl.SSLContext | None:
    """The ingest endpoint's TLS context from daemon.ingest_tls_cert/key; None: plain HTTP."""
    if not cert and not key:
        return None
    if not cert or not key:
        from slurmft.config import ConfigError

        raise ConfigError(
            "daemon.ingest_tls_cert and daemon.ingest_tls_key go together: set both for TLS, "
            "or neither for plain HTTP"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        from slurmft.config import ConfigError

        raise ConfigError(
            f"cannot load the ingest TLS certificate {cert} with key {key}: {exc}"
        ) from None
    return context


class IngestServer:
    """Serves BATCH_PATH and TIME_PATH on ``host:port`` (over TLS with ``tls``) within
    ``limits``."""

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
        limits: ServerLimits = DEFAULT_LIMITS,
        tls: ssl.SSLContext | None = None,
        on_refusal: RefusalSink | None = None,
        on_connection_refused: Callable[[str, Connection], None] | None = None,
        rate_limits: RateLimits | None = None,
    ) -> None:
        self._committer = GroupCommitter(
            database,
            clock=clock,
            sample_every=sample_every,
            restart_ttl=restart_ttl,
            limiter=IngestLimiter(rate_limits or RateLimits()),
        )
        handler = type(
            "Handler",
            (_Handler,),
            {
                "committer": self._committer,
                "tokens": TokenBook(database),
                "clock": staticmethod(clock),
                # Metrics hook: (HTTP status, seconds) of every batch POST.
                "observe": staticmethod(observe or _ignore),
                "refused": staticmethod(on_refusal or _no_sink),
            },
        )
        self.tls = tls
        self.server = BoundedServer(
            tcp_listener(host, port),
            HttpProtocol(handler, keep_alive=True),
            limits,
            "slurmft-ingest",
            on_refusal=on_connection_refused,
            tls=tls,
        )

    @property
    def committer(self) -> GroupCommitter:
        """The writer the request threads hand their batches to (tests hold it: `hold`)."""
        return self._committer

    @property
    def url(self) -> str:
        host, port = self.server.listener.getsockname()[:2]
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> IngestServer:
        self._committer.start()
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self._committer.stop()


class _Handler(BoundedHTTPHandler):
    committer: GroupCommitter
    tokens: TokenBook
    clock: Callable[[], datetime]
    observe: Callable[[int, float], None]
    refused: RefusalSink
    _started = 0.0
    _caller: Caller | None = None

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
            if isinstance(exc, _HeadRefused):
                self.refused(exc.reason, self._caller, str(exc))
            if exc.items is not None:  # only some items: the agent drops them, sends the rest
                self._reply(HTTPStatus.UNPROCESSABLE_ENTITY, exc.items.reply().to_json())
            else:
                self._error(HTTPStatus(exc.status), str(exc), exc.retry_after_s)
        except ItemsRefused as exc:  # items not of the wire's types
            self._reply(HTTPStatus.UNPROCESSABLE_ENTITY, exc.reply().to_json())
        except ProtocolError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except (DatabaseUnavailable, IntegrityError) as exc:
            # The store is away, or a concurrent resend of the same batch won: retry later.
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"retry later: {type(exc).__name__}")
        except Exception:
            log.exception("ingest failed")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the daemon's log")

    def _ingest(self) -> bytes:
        """Check the token and the length from the headers; only then read and parse the body."""
        token = _bearer(self.headers.get("Authorization", ""))
        if token is None:
            raise _HeadRefused(401, "no_token", "missing 'Authorization: Bearer <run token>'")
        self._caller = self.tokens.caller(token)
        if self._caller is None:
            raise _HeadRefused(401, "unknown_token", "token not valid for any run")
        length = self.headers.get("Content-Length")
        if length is None:
            raise _HeadRefused(411, "no_length", "Content-Length required")
        length = length.strip()
        if not _DIGITS.fullmatch(length):
            raise _HeadRefused(
                400, "bad_length", f"Content-Length {length[:40]!r} is not a byte count"
            )
        if int(length) > MAX_BODY_BYTES:
            raise _HeadRefused(413, "too_large", f"body of {length} bytes is over {MAX_BODY_BYTES}")
        try:
            body = self.rfile.read(int(length))
        except TimeoutError:
            raise _HeadRefused(
                408, "body_timeout", "the request body did not arrive in time"
            ) from None
        if len(body) < int(length):
            raise _HeadRefused(400, "short_body", f"body ended after {len(body)} of {length} bytes")
        batch = AgentBatch.from_json(body)
        return self.committer.submit(batch, token).to_json()

    def _reply(self, status: HTTPStatus, body: bytes, retry_after_s: float | None = None) -> None:
        if self.command == "POST" and self.path == BATCH_PATH:
            # Counted before the answer leaves: whoever got it then sees it on /metrics.
            self.observe(int(status), time.monotonic() - self._started)
        self.send_response(status)
        if retry_after_s is not None:
            self.send_header("Retry-After", str(max(1, math.ceil(retry_after_s))))
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str, retry_after_s: float | None = None) -> None:
        self.close_connection = True  # an unread body must never be parsed as the next request
        # A client that is gone, or does not read, is told nothing more.
        with contextlib.suppress(OSError):
            self._reply(status, json.dumps({"error": message}).encode(), retry_after_s)


def _ignore(_status: int, _seconds: float) -> None:
    pass


def _bearer(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
