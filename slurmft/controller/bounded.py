"""Servers whose threads, memory and time per client are bounded, whatever the clients do.

One selector thread accepts connections and reads each request's head without blocking: an
idle connection or one that sends a byte a second costs a file descriptor and a small buffer,
never a thread. The whole head must arrive within ``header_timeout_s`` of the accept (and no
gap between bytes may exceed ``idle_timeout_s``), or the connection is refused and closed. A
complete head goes to a pool of at most ``workers`` threads, started as needed; the worker
answers it (reading a body within ``body_timeout_s``) and closes the connection, or, where the
protocol keeps it for the client's next request (HTTP keep-alive), hands it back to the selector
thread: a kept connection waiting for its next request holds no thread either, and one idle for
``idle_timeout_s`` is closed without a word (nothing was asked of it). At most
``max_connections`` connections are open at once; past that the kept connection idle longest
is closed to make room, and without one a new connection gets its refusal at once (an HTTP 503
with Retry-After, the socket's JSON error) and is closed.

Each refusal is handed to the server's ``on_refusal`` hook (a counter, a log line, an audit row
where the caller is known). The protocol, HTTP or the CLI's JSON line, is a ``Protocol``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from typing import Protocol as TypingProtocol

log = logging.getLogger(__name__)

# How often the selector thread looks for connections past their deadlines: a slow connection
# is closed within this much of its timeout.
SWEEP_INTERVAL_S = 0.05
ACCEPTS_PER_WAKEUP = 256
RECV_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold of a server."""

    max_connections: int
    workers: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    max_head_bytes: int = 64 * 1024
    listen_backlog: int = 1024
    # Connections one caller (the socket's peer uid; root exempt) may hold; 0: no such cap.
    max_per_caller: int = 0


class Reason:
    """Why a connection was refused (the metric's ``reason`` label)."""

    OVER_CAPACITY = "over_capacity"
    OVER_CALLER_CAP = "over_caller_cap"
    HEADER_TIMEOUT = "header_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    HEAD_TOO_LARGE = "head_too_large"
    TLS_HANDSHAKE = "tls_handshake"


@dataclass
class Connection:
    """One accepted connection while its head arrives."""

    sock: socket.socket
    peer: Any
    accepted_at: float
    last_byte_at: float
    buffer: bytearray = field(default_factory=bytearray)
    handshaking: bool = False
    body_deadline: float = 0.0  # set when a worker takes it (monotonic)
    # What the protocol learned at accept (the socket's peer uid).
    caller: dict[str, Any] = field(default_factory=dict)
    # Kept after an answer, no byte of its next request yet: closed quietly when idle.
    kept: bool = False


class Protocol(TypingProtocol):
    def accepted(self, conn: Connection) -> None:
        """Called once a connection is accepted (e.g. to read its peer's credentials)."""

    def head_complete(self, buffer: bytearray) -> bool:
        """Whether ``buffer`` holds the whole request head."""

    def refusal(self, reason: str, limits: ServerLimits) -> bytes:
        """What a refused connection is sent before it is closed."""

    def serve(self, conn: Connection) -> bool:
        """Answer the request whose head is ``conn.buffer`` (on a worker thread, blocking; the
        rest by ``conn.body_deadline``). True: keep the connection for the client's next
        request (nothing of this one left unread); False: close it."""


RefusalHook = Callable[[str, Connection], None]


class BoundedServer:
    """Serves ``protocol`` on ``listener`` within ``limits`` (see the module's docstring)."""

    def __init__(
        self,
        listener: socket.socket,
        protocol: Protocol,
        limits: ServerLimits,
        name: str,
        *,
        on_refusal: RefusalHook | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.listener = listener
        self.protocol = protocol
        self.limits = limits
        self.name = name
        self.tls = tls
        self._on_refusal = on_refusal or (lambda _reason, _conn: None)
        listener.listen(limits.listen_backlog)
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._reading: dict[int, Connection] = {}  # fd -> connection whose head is arriving
        self._lock = threading.Lock()
        self._open = 0  # every connection held: arriving, queued, or with a worker
        self._per_caller: dict[int, int] = {}
        self._work: queue.SimpleQueue[Connection | None] = queue.SimpleQueue()
        self._kept: queue.SimpleQueue[Connection] = queue.SimpleQueue()  # back from workers
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._pending = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        for _ in self._workers:
            self._work.put(None)
        for conn in list(self._reading.values()):
            self._close(conn)
        self._reading.clear()
        while not self._kept.empty():
            self._close(self._kept.get())
        self._selector.close()
        self.listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    @property
    def worker_threads(self) -> int:
        with self._lock:
            return len(self._workers)

    # --- the selector thread -----------------------------------------------------------------

    def _loop(self) -> None:
        next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        while not self._stopping.is_set():
            try:
                events = self._selector.select(timeout=SWEEP_INTERVAL_S)
            except OSError:  # closed under us by stop()
                return
            for key, _mask in events:
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    self._take_back_kept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + SWEEP_INTERVAL_S

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits for the next wakeup
                log.warning("%s: accept failed: %s", self.name, exc)
                return
            now = time.monotonic()
            conn = Connection(sock, peer, now, now)
            with self._lock:
                self._open += 1
                over = self._open > self.limits.max_connections
            try:
                self.protocol.accepted(conn)
            except OSError:
                self._close(conn)
                continue
            if over and not self._make_room():
                self._refuse(conn, Reason.OVER_CAPACITY, send=self.tls is None)
                continue
            if not self._admit_caller(conn):
                self._refuse(conn, Reason.OVER_CALLER_CAP, send=self.tls is None)
                continue
            sock.setblocking(False)
            if self.tls is not None:
                try:
                    conn.sock = self.tls.wrap_socket(
                        sock, server_side=True, do_handshake_on_connect=False
                    )
                except (OSError, ssl.SSLError):
                    self._close(conn)
                    continue
                conn.handshaking = True
            self._reading[conn.sock.fileno()] = conn
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Connection) -> None:
        if conn.handshaking:
            assert isinstance(conn.sock, ssl.SSLSocket)
            try:
                conn.sock.do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except (OSError, ssl.SSLError) as exc:
                conn.caller.setdefault("detail", str(exc))
                self._refuse(conn, Reason.TLS_HANDSHAKE, send=False)
                return
            conn.handshaking = False
        while True:
            try:
                data = conn.sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return
            except (OSError, ssl.SSLError):
                self._drop(conn)
                return
            if not data:  # the client went away before its request was complete
                self._drop(conn)
                return
            conn.buffer += data
            conn.last_byte_at = time.monotonic()
            if conn.kept:  # its next request begins: the head's deadline runs from here
                conn.kept = False
                conn.accepted_at = conn.last_byte_at
            if self.protocol.head_complete(conn.buffer):
                self._dispatch(conn)
                return
            if len(conn.buffer) > self.limits.max_head_bytes:
                self._refuse(conn, Reason.HEAD_TOO_LARGE)
                return

    def _make_room(self) -> bool:
        """At the cap, close the kept connection idle longest (its client connects again when it
        next posts) rather than refuse a new client: kept connections must not lock others out."""
        idle = [conn for conn in self._reading.values() if conn.kept]
        if not idle:
            return False
        self._drop(min(idle, key=lambda conn: conn.last_byte_at))
        return True

    def _sweep(self, now: float) -> None:
        header_s, idle_s = self.limits.header_timeout_s, self.limits.idle_timeout_s
        for conn in list(self._reading.values()):
            if conn.kept:
                if now >= conn.last_byte_at + idle_s:
                    self._drop(conn)
                continue
            if now >= conn.accepted_at + header_s:
                self._refuse(conn, Reason.HEADER_TIMEOUT)
            elif now >= conn.last_byte_at + idle_s:
                self._refuse(conn, Reason.IDLE_TIMEOUT)

    def _unregister(self, conn: Connection) -> None:
        if self._reading.pop(conn.sock.fileno(), None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(conn.sock)

    def _drop(self, conn: Connection) -> None:
        self._unregister(conn)
        self._close(conn)

    def _refuse(self, conn: Connection, reason: str, *, send: bool = True) -> None:
        self._unregister(conn)
        if send and not conn.handshaking:
            with contextlib.suppress(OSError, ssl.SSLError):
                conn.sock.setblocking(False)
                conn.sock.send(self.protocol.refusal(reason, self.limits))
        self._close(conn)
        try:
            self._on_refusal(reason, conn)
        except Exception:
            log.exception("%s: recording a refusal failed", self.name)

    def _admit_caller(self, conn: Connection) -> bool:
        """Whether the caller may hold one more connection (counted if so)."""
        uid = conn.caller.get("uid")
        if not self.limits.max_per_caller or not isinstance(uid, int) or uid == 0:
            return True
        with self._lock:
            held = self._per_caller.get(uid, 0)
            if held >= self.limits.max_per_caller:
                return False
            self._per_caller[uid] = held + 1
        conn.caller["counted"] = True
        return True

    def _close(self, conn: Connection) -> None:
        with contextlib.suppress(OSError):
            conn.sock.close()
        with self._lock:
            self._open -= 1
            if conn.caller.pop("counted", False):
                uid = conn.caller["uid"]
                self._per_caller[uid] -= 1
                if not self._per_caller[uid]:
                    del self._per_caller[uid]

    # --- the workers -------------------------------------------------------------------------

    def _dispatch(self, conn: Connection) -> None:
        self._unregister(conn)
        with self._lock:
            self._pending += 1
            if self._pending > self._idle and len(self._workers) < self.limits.workers:
                worker = threading.Thread(
                    target=self._worker, name=f"{self.name}-{len(self._workers)}", daemon=True
                )
                self._workers.append(worker)
                worker.start()
        self._work.put(conn)

    def _worker(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            conn = self._work.get()
            with self._lock:
                self._idle -= 1
                if conn is not None:
                    self._pending -= 1
            if conn is None or self._stopping.is_set():
                if conn is not None:
                    self._close(conn)
                return
            keep = False
            try:
                conn.sock.setblocking(True)
                conn.sock.settimeout(self.limits.body_timeout_s)
                conn.body_deadline = time.monotonic() + self.limits.body_timeout_s
                keep = self.protocol.serve(conn) and not self._stopping.is_set()
            except Exception:
                log.exception("%s: serving a request failed", self.name)
            finally:
                if keep and self._keepable(conn):
                    self._keep(conn)
                else:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    self._close(conn)

    @staticmethod
    def _keepable(conn: Connection) -> bool:
        # TLS may hold bytes it decrypted already, which the selector would never see.
        return not isinstance(conn.sock, ssl.SSLSocket) or conn.sock.pending() == 0

    def _keep(self, conn: Connection) -> None:
        """Hand an answered connection back to the selector thread for its next request."""
        now = time.monotonic()
        conn.buffer = bytearray()
        conn.kept, conn.accepted_at, conn.last_byte_at = True, now, now
        conn.sock.setblocking(False)
        self._kept.put(conn)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"k")

    def _take_back_kept(self) -> None:
        while not self._kept.empty():
            conn = self._kept.get()
            fd = conn.sock.fileno()
            try:
                self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError, KeyError):  # closed meanwhile
                self._close(conn)
                continue
            self._reading[fd] = conn


class DeadlineReader(io.RawIOBase):
    """The bytes already read (the head), then the socket's, all by ``deadline`` (monotonic):
    a body that trickles in is cut off at the deadline, however steadily it trickles."""

    def __init__(self, prefix: bytes, sock: socket.socket, deadline: float) -> None:
        self._prefix = memoryview(prefix)
        self._sock = sock
        self._deadline = deadline
        self._ended = False

    def readable(self) -> bool:
        return True

    def end(self) -> int:
        """Read nothing more from the socket; how many bytes of the prefix were never read."""
        self._ended = True
        return len(self._prefix)

    def readinto(self, buffer: Any) -> int:
        if self._ended:
            return 0
        if self._prefix:
            n = min(len(buffer), len(self._prefix))
            buffer[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request body did not arrive in time")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)


class SocketWriter(io.BufferedIOBase):
    """Writes straight to the socket (its timeout bounds a client that does not read)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any, /) -> int:
        self._sock.sendall(data)
        return len(data)


class BoundedHTTPHandler(BaseHTTPRequestHandler):
    """A request handler served by ``BoundedServer``: its head was read by the selector thread,
    its body is read by the connection's deadline, and it answers one request; the connection
    is then closed, or kept for the next one (see ``HttpProtocol``)."""

    request: Connection
    server_version = "slurmft"

    def setup(self) -> None:
        conn = self.request
        self.connection = conn.sock
        self._reader = DeadlineReader(bytes(conn.buffer), conn.sock, conn.body_deadline)
        self._buffered = io.BufferedReader(self._reader)
        self.rfile = self._buffered
        self.wfile = SocketWriter(conn.sock)

    def handle(self) -> None:
        self.handle_one_request()  # one: the next waits in the selector, holding no thread

    def finish(self) -> None:
        pass

    def all_read(self) -> bool:
        """Whether every byte received was part of the request answered (a client that sent
        its next request before this answer, pipelining, gets its connection closed)."""
        return self._reader.end() == 0 and not self._buffered.peek(0)


_HTTP_REFUSALS = {
    Reason.OVER_CAPACITY: (HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; retry"),
    Reason.OVER_CALLER_CAP: (HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; retry"),
    Reason.HEADER_TIMEOUT: (HTTPStatus.REQUEST_TIMEOUT, "the request head did not arrive in time"),
    Reason.IDLE_TIMEOUT: (HTTPStatus.REQUEST_TIMEOUT, "the connection was idle too long"),
    Reason.HEAD_TOO_LARGE: (
        HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
        "the request head is too large",
    ),
}


def http_reply(status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.0 answer with a JSON ``{"error": message}`` body."""
    body = json.dumps({"error": message}).encode()
    lines = [
        f"HTTP/1.0 {status.value} {status.phrase}",
        "Server: slurmft",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class HttpProtocol:
    """HTTP/1.x answered by ``handler``: one request per connection, or with ``keep_alive`` the
    client's HTTP/1.1 keep-alive honoured (a connection per client for as long as it posts
    more often than ``idle_timeout_s``, instead of a TCP connection per request)."""

    def __init__(self, handler: type[BoundedHTTPHandler], keep_alive: bool = False) -> None:
        self.handler = handler
        if keep_alive:
            self.handler = type(handler.__name__, (handler,), {"protocol_version": "HTTP/1.1"})

    def accepted(self, conn: Connection) -> None:
        pass

    def head_complete(self, buffer: bytearray) -> bool:
        return b"\n\r\n" in buffer or b"\n\n" in buffer

    def refusal(self, reason: str, limits: ServerLimits) -> bytes:
        status, message = _HTTP_REFUSALS.get(reason, (HTTPStatus.BAD_REQUEST, "refused"))
        if reason == Reason.OVER_CAPACITY:
            message = f"{limits.max_connections} connections open; retry"
            return http_reply(status, message, {"Retry-After": "1"})
        if reason == Reason.HEADER_TIMEOUT:
            message += f" ({limits.header_timeout_s:g} s)"
        return http_reply(status, message)

    def serve(self, conn: Connection) -> bool:
        handler = self.handler(conn, conn.peer, self)  # type: ignore[arg-type]  # its request
        return not handler.close_connection and handler.all_read()


def tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class RefusalLog:
    """One log line per refusal, at most a few a second per reason: past that the lines say how
    many were refused since the last one (a flood must not flood the journal too)."""

    def __init__(self, name: str, per_reason_interval_s: float = 1.0) -> None:
        self.name = name
        self._interval = per_reason_interval_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, reason: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(reason, -1e9) < self._interval:
                self._quiet[reason] = self._quiet.get(reason, 0) + 1
                return
            self._last[reason] = now
            quiet = self._quiet.pop(reason, 0)
        more = f" ({quiet} more refused for {reason} since the last line)" if quiet else ""
        log.warning("%s refused a connection (%s): %s%s", self.name, reason, message, more)
