"""The daemon's agent endpoint as an agent sees it: a stand-in HTTP server for agent tests.

It answers as the real ingest (slurmft.controller.http over slurmft.controller.ingest) does;
tests/integration/test_daemon_contract.py runs the same assertions against both:

- a batch is acknowledged with its own ``seq``; a resend (a ``seq`` at or below the agent's
  newest stored one) is acknowledged again and stored once;
- given run tokens, a batch without a bearer token, or with one that is no run's, is refused
  with 401 before its body is read, one whose token is another run's (or whose run is unknown)
  with 403, and nothing of it is stored; without run tokens
  every batch is taken (agents under test that were given no token);
- a batch out of the wire's bounds is refused with 400 when its header is, with 422 naming the
  refused items (slurmft.protocol.RefusedItems) when only some items are, and nothing of it is
  stored;
- every reply carries the commands ordered for the batch's node: ``leave`` on every reply while
  the order stands, ``restart_workers`` once (and not while the node is told to leave);
- ``GET TIME_PATH`` answers the server's clock, ``clock_offset_s`` ahead of this machine's.

What the real daemon does not do on request: ``fail_first`` answers 503 to that many posts, as
a daemon that is restarting would.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from slurmft.protocol import (
    BATCH_PATH,
    CONTENT_TYPE,
    TIME_PATH,
    AgentBatch,
    BatchReply,
    Command,
    CommandKind,
    ItemsRefused,
    ProtocolError,
    TimeReply,
    check_batch,
)


class Refused(Exception):
    """A post the daemon would refuse: the status and the reason."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class FakeController:
    """Records every batch and answers with the commands ordered for its node."""

    def __init__(
        self, run_tokens: Mapping[str, str] | None = None, *, clock_offset_s: float = 0.0
    ) -> None:
        self.run_tokens = dict(run_tokens) if run_tokens is not None else None
        self.clock_offset_s = clock_offset_s
        self.fail_first = 0
        self.attempts: list[AgentBatch] = []  # every batch posted, resends and refusals too
        self.tokens: list[str] = []  # the Authorization header of every post
        self.accepted: list[AgentBatch] = []  # stored: each (run, agent, seq) once
        self._cursors: dict[tuple[str, str], int] = {}
        self._leave: dict[str, Command] = {}
        self._once: dict[str, list[Command]] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeController:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def order(self, node: str, command: Command) -> None:
        """What the daemon decided for ``node``: a leave stands, a restart is delivered once."""
        with self._lock:
            if command.kind is CommandKind.LEAVE:
                self._leave[node] = command
            else:
                self._once.setdefault(node, []).append(command)

    def received(self) -> list[AgentBatch]:
        """The stored batches, in the order they came."""
        with self._lock:
            return list(self.accepted)

    def now(self) -> float:
        return time.time() + self.clock_offset_s

    def answer(self, body: bytes, authorization: str) -> BatchReply:
        """Store the posted batch (once) and say what its node must do; Refused when it is
        refused. The checks come in the real daemon's order: the token's presence and whether
        it is any run's (from the headers), the body, then whether the token is the run's."""
        with self._lock:
            self.tokens.append(authorization)
            token = _bearer(authorization)
            if token is None and self.run_tokens is not None:
                raise Refused(HTTPStatus.UNAUTHORIZED, "missing 'Authorization: Bearer <token>'")
            if self.run_tokens is not None and token not in self.run_tokens.values():
                raise Refused(HTTPStatus.UNAUTHORIZED, "token not valid for any run")
            batch = _parse(body)
            self.attempts.append(batch)
            if len(self.attempts) <= self.fail_first:
                raise Refused(HTTPStatus.SERVICE_UNAVAILABLE, "daemon restarting")
            if self.run_tokens is not None and self.run_tokens.get(batch.run_id) != token:
                raise Refused(HTTPStatus.FORBIDDEN, f"token not valid for run {batch.run_id}")
            check_batch(batch, self.now())
            agent = (batch.run_id, batch.agent_id)
            if batch.seq > self._cursors.get(agent, 0):  # at or below: a resend, acked again
                self._cursors[agent] = batch.seq
                self.accepted.append(batch)
            return BatchReply(batch.seq, self.now(), self._commands_for(batch.node))

    def _commands_for(self, node: str) -> tuple[Command, ...]:
        if node in self._leave:
            return (self._leave[node],)
        return tuple(self._once.pop(node, ()))


def _handler_for(fake: FakeController) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path != TIME_PATH:
                self._reply(HTTPStatus.NOT_FOUND, b'{"error": "no such path"}')
                return
            self._reply(HTTPStatus.OK, TimeReply(fake.now()).to_json())

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                if self.path != BATCH_PATH:
                    raise Refused(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
                reply = fake.answer(body, self.headers.get("Authorization", ""))
            except Refused as refused:
                self._reply(refused.status, json.dumps({"error": str(refused)}).encode())
                return
            except ItemsRefused as refused:
                self._reply(HTTPStatus.UNPROCESSABLE_ENTITY, refused.reply().to_json())
                return
            except ProtocolError as error:
                self._reply(HTTPStatus.BAD_REQUEST, json.dumps({"error": str(error)}).encode())
                return
            self._reply(HTTPStatus.OK, reply.to_json())

        def _reply(self, status: HTTPStatus, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def _bearer(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _parse(body: bytes) -> AgentBatch:
    try:
        return AgentBatch.from_json(body)
    except ItemsRefused:
        raise
    except ProtocolError as error:
        raise Refused(HTTPStatus.BAD_REQUEST, str(error)) from None
