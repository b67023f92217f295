"""Batches of rank reports to the controller over HTTP: at least once, never blocking the agent.

A background thread sends what has accumulated every `interval_s` as one `AgentBatch` with the
next sequence number. A batch that fails with a network error or a 5xx is resent *unchanged*
(same seq) with exponential back-off until the controller answers, so a daemon restart loses
nothing and ingest can drop duplicates. Meanwhile new reports wait in a bounded buffer: when it
is full the oldest heartbeats go first (the next heartbeat supersedes them), then the oldest step
times; events are never dropped. A 4xx reply means the controller will never take that batch
(bad token, malformed): it is logged and dropped, not retried forever; but a 422 that names
some items (out of bounds: an event time far ahead, a NUL in a message) drops exactly those, and
the rest of the batch is sent again under the same seq (the daemon stored none of it), so one bad
event never costs the good heartbeats beside it. 408 and 429 (over the run's ingest rate) are
retried like a 5xx.

An agent with nothing to report (a spare, or a node whose workers froze) still sends an empty
batch every `keepalive_s`: commands ride on the replies, and the controller tells a live agent
from a frozen one by whether it still fetches them.
"""

from __future__ import annotations

import http.client
import logging
import random
import ssl
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from slurmft.config import AgentSection, ConfigError
from slurmft.protocol import (
    BATCH_PATH,
    CONTENT_TYPE,
    ITEM_LISTS,
    MAX_BATCH_EVENTS,
    MAX_BODY_BYTES,
    TIME_PATH,
    AgentBatch,
    AgentEvent,
    AllocationReport,
    BatchReply,
    Command,
    ItemRefusal,
    ProtocolError,
    RankHeartbeat,
    RankStepTime,
    RefusedItems,
    TimeReply,
)

log = logging.getLogger(__name__)


# Batches a second one run's agents may send together: the daemon's ingest keeps up with 1,024
# a second on one core, on SQLite and PostgreSQL, and not with 2,048 (scripts/bench/ingest_load.py,
# docs/operations.md "Ingest under load"). A larger run's agents send less often, each batch
# carrying more: the same reports, fewer requests.
MAX_RUN_BATCHES_PER_S = 1024


def report_interval_s(configured_s: float, agents: int) -> float:
    """How often each of a run's ``agents`` sends a batch: ``configured_s`` (agent.
    report_interval_s), lengthened so that the run sends at most MAX_RUN_BATCHES_PER_S."""
    return max(configured_s, agents / MAX_RUN_BATCHES_PER_S)


class RetryableError(Exception):
    """The controller is away or failing: keep the batch and try again later."""


class RejectedError(Exception):
    """The controller refused the batch (4xx): resending it cannot help."""


class ItemsRejectedError(RejectedError):
    """The controller refused some items of the batch (422) and stored none of it."""

    def __init__(self, message: str, refused: tuple[ItemRefusal, ...]) -> None:
        super().__init__(message)
        self.refused = refused


class CertificateError(RetryableError):
    """The controller's TLS certificate did not verify against the agent's CA file. Retried
    like any outage (an operator may fix the certificate), but said plainly."""


class HttpTransport:
    """POST/GET JSON to the controller with the run's token (stdlib only). An https URL is
    verified against ``ca_file`` (agent.ca_file), else the system's CAs.

    One connection is kept between requests (HTTP/1.1 keep-alive): an agent posting once a
    second costs the daemon a request a second, not a TCP connection a second. A kept
    connection the daemon has closed meanwhile (it closes idle ones) is found out on the next
    request, which is sent once more on a new connection: a batch is idempotent (its seq)."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 5.0, ca_file: str = ""):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.ca_file = ca_file
        self._context: ssl.SSLContext | None = None
        if self.base_url.startswith("https:"):
            self._context = ssl.create_default_context(cafile=ca_file or None)
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(
                f"agent.controller_url {base_url!r} is not http://host:port or https://host:port"
            )
        self._host, self._port, self._prefix = url.hostname, url.port, url.path
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # one request at a time on the kept connection

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._context is not None:
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self.timeout_s, context=self._context
                )
            else:
                self._conn = http.client.HTTPConnection(
                    self._host, self._port, timeout=self.timeout_s
                )
        return self._conn

    def _exchange(self, path: str, body: bytes | None) -> tuple[int, bytes]:
        """One request and its reply on the kept connection, sent again once on a new one when
        the kept one turns out closed (nothing came back on it)."""
        headers = {"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {self.token}"}
        method = "POST" if body is not None else "GET"
        for attempt in (1, 2):
            reused = self._conn is not None
            conn = self._connection()
            try:
                conn.request(method, self._prefix + path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read(MAX_BODY_BYTES)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop()
                if reused and attempt == 1:
                    continue  # closed by the daemon while kept: once more, on a new one
                raise
            except BaseException:
                self._drop()
                raise
            if response.will_close or not response.isclosed():  # closing, or a reply too long
                self._drop()
            return response.status, data
        raise AssertionError("unreachable")

    def _request(self, path: str, body: bytes | None) -> bytes:
        try:
            with self._lock:
                status, reply = self._exchange(path, body)
        except ssl.SSLCertVerificationError as error:
            raise CertificateError(
                f"the controller's TLS certificate at {self.base_url} is not trusted "
                f"({error.verify_message}) by "
                f"{f'CA file {self.ca_file}' if self.ca_file else 'the system CAs'}: "
                f"set agent.ca_file (daemon.agents_ca_file) to the CA that signed it"
            ) from None
        except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out
            raise RetryableError(str(error) or type(error).__name__) from None
        if status < 400:
            return reply
        detail = reply[:300].decode(errors="replace")
        if status == 422:
            try:
                refusal = RefusedItems.from_json(reply)
            except ProtocolError:
                pass
            else:
                raise ItemsRejectedError(refusal.error, refusal.refused) from None
        if 400 <= status < 500 and status not in (408, 429):
            raise RejectedError(f"HTTP {status}: {detail}")
        raise RetryableError(f"HTTP {status}: {detail}")

    def send_batch(self, batch: AgentBatch) -> BatchReply:
        reply = self._request(BATCH_PATH, batch.to_json())
        try:
            return BatchReply.from_json(reply)
        except ProtocolError as error:
            raise RetryableError(f"unreadable reply: {error}") from None

    def server_time(self) -> float:
        try:
            return TimeReply.from_json(self._request(TIME_PATH, None)).server_time
        except ProtocolError as error:
            raise RetryableError(f"unreadable reply: {error}") from None


@dataclass
class BufferCounters:
    dropped_heartbeats: int = 0
    dropped_step_times: int = 0
    rejected_batches: int = 0
    refused_items: int = 0  # dropped alone, the rest of their batch sent again
    sent_batches: int = 0
    send_failures: int = 0


@dataclass
class ReportBuffer:
    """Reports waiting for the next batch, bounded by `max_items` (events exempt)."""

    max_items: int = AgentSection.report_buffer_max
    heartbeats: deque[RankHeartbeat] = field(default_factory=deque)
    step_times: deque[RankStepTime] = field(default_factory=deque)
    events: deque[AgentEvent] = field(default_factory=deque)
    counters: BufferCounters = field(default_factory=BufferCounters)

    def __len__(self) -> int:
        return len(self.heartbeats) + len(self.step_times) + len(self.events)

    def add(self, record: RankHeartbeat | RankStepTime | AgentEvent) -> None:
        if isinstance(record, RankHeartbeat):
            self.heartbeats.append(record)
        elif isinstance(record, RankStepTime):
            self.step_times.append(record)
        else:
            self.events.append(record)
        self._shed()

    def _shed(self) -> None:
        while len(self) > self.max_items:
            if self.heartbeats:
                self.heartbeats.popleft()
                self.counters.dropped_heartbeats += 1
            elif self.step_times:
                self.step_times.popleft()
                self.counters.dropped_step_times += 1
            else:
                return  # only events left: they are kept whatever the bound

    def take(self, limit: int) -> tuple[list[RankHeartbeat], list[RankStepTime], list[AgentEvent]]:
        """Up to `limit` records, events first (they matter most), at most MAX_BATCH_EVENTS
        of them (the daemon refuses more in one batch)."""
        events = _pop(self.events, min(limit, MAX_BATCH_EVENTS))
        step_times = _pop(self.step_times, limit - len(events))
        heartbeats = _pop(self.heartbeats, limit - len(events) - len(step_times))
        return heartbeats, step_times, events


T = TypeVar("T")


def _pop(queue: deque[T], limit: int) -> list[T]:
    return [queue.popleft() for _ in range(min(limit, len(queue)))]


def _items(batch: AgentBatch) -> int:
    return len(batch.heartbeats) + len(batch.step_times) + len(batch.events)


def without_items(batch: AgentBatch, refused: Sequence[ItemRefusal]) -> AgentBatch | None:
    """The batch less the refused items; None when the refusal names none of its items (then
    the whole batch is dropped, so a refusal can never make an agent loop)."""
    named: dict[str, set[int]] = {items: set() for items in ITEM_LISTS}
    for item in refused:
        if item.items in named and 0 <= item.index < len(getattr(batch, item.items)):
            named[item.items].add(item.index)
    if not any(named.values()):
        return None
    kept = {
        items: tuple(x for i, x in enumerate(getattr(batch, items)) if i not in named[items])
        for items in ITEM_LISTS
    }
    return msgspec.structs.replace(batch, **kept)


def backoff_s(failures: int, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Exponential with ±20 % jitter, so agents that lost the controller together spread out."""
    # The exponent is bounded: 2 ** 1024 is past any float, and an agent whose daemon stayed
    # away for hours (about 1,000 failed sends at the cap) must keep trying, not crash.
    factor: int = 2 ** min(max(0, failures - 1), 32)
    return min(cap_s, base_s * factor) * random.uniform(0.8, 1.2)


class Reporter:
    """Owns the buffer and the send thread; `on_command` gets each command of every reply."""

    def __init__(
        self,
        transport: HttpTransport,
        *,
        run_id: str,
        node: str,
        on_command: Callable[[Command], None],
        interval_s: float = AgentSection.report_interval_s,
        max_buffered: int = AgentSection.report_buffer_max,
        max_batch_items: int = 5_000,
        backoff_cap_s: float = 30.0,
        keepalive_s: float = 2.0,
        agent_id: str = "",
    ):
        self.transport = transport
        self.run_id, self.node = run_id, node
        self.agent_id = agent_id or f"{node}-{uuid.uuid4().hex[:12]}"
        self.on_command = on_command
        self.interval_s, self.max_batch_items, self.backoff_cap_s = (
            interval_s,
            max_batch_items,
            backoff_cap_s,
        )
        self.keepalive_s = keepalive_s
        self._last_batch_at = time.monotonic()
        self.buffer = ReportBuffer(max_buffered)
        self.counters = self.buffer.counters
        self.seq = 0
        self.in_flight: AgentBatch | None = None
        self.allocation: AllocationReport | None = None  # the next batch carries it
        self.failures = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, record: RankHeartbeat | RankStepTime | AgentEvent) -> None:
        with self._lock:
            self.buffer.add(record)

    def add_event(self, event: AgentEvent) -> None:
        """An event is sent at once, not at the next interval."""
        self.add(event)
        self._wake.set()

    def report_allocation(self, report: AllocationReport) -> None:
        """The batch step's allocation, sent at once (a newer one not sent yet replaces it)."""
        with self._lock:
            self.allocation = report
        self._wake.set()

    def pending(self) -> int:
        with self._lock:
            waiting = len(self.buffer) + (0 if self.allocation is None else 1)
            return waiting + (0 if self.in_flight is None else 1)

    def _next_batch(self) -> AgentBatch | None:
        with self._lock:
            idle_s = time.monotonic() - self._last_batch_at
            due = len(self.buffer) or self.allocation is not None or idle_s >= self.keepalive_s
            if self.in_flight is None and due:
                self._last_batch_at = time.monotonic()
                heartbeats, step_times, events = self.buffer.take(self.max_batch_items)
                self.seq += 1
                self.in_flight = AgentBatch(
                    run_id=self.run_id,
                    agent_id=self.agent_id,
                    node=self.node,
                    seq=self.seq,
                    sent_at=time.time(),
                    heartbeats=tuple(heartbeats),
                    step_times=tuple(step_times),
                    events=tuple(events),
                    allocation=self.allocation,
                )
                self.allocation = None
            return self.in_flight

    def send_once(self) -> bool:
        """Send the in-flight (or a new) batch; True when nothing is left in flight."""
        batch = self._next_batch()
        if batch is None:
            return True
        while True:
            try:
                reply = self.transport.send_batch(batch)
            except RetryableError as error:
                self.failures += 1
                self.counters.send_failures += 1
                log.warning(
                    "controller unreachable (%s); batch %d kept, %d buffered",
                    error,
                    batch.seq,
                    len(self.buffer),
                )
                return False
            except ItemsRejectedError as error:
                rest = without_items(batch, error.refused)
                if rest is None:
                    self._rejected(batch, error)
                    break
                dropped = _items(batch) - _items(rest)
                self.counters.refused_items += dropped
                log.error(
                    "controller refused %d item(s) of batch %d, dropped them, sending "
                    "the rest again: %s",
                    dropped,
                    batch.seq,
                    error,
                )
                with self._lock:
                    self.in_flight = batch = rest  # the same seq: none of it was stored
                continue  # each round drops at least one item: this ends
            except RejectedError as error:
                self._rejected(batch, error)
                break
            self.counters.sent_batches += 1
            for command in reply.commands:
                self.on_command(command)
            break
        self.failures = 0
        with self._lock:
            self.in_flight = None
        return True

    def _rejected(self, batch: AgentBatch, error: RejectedError) -> None:
        self.counters.rejected_batches += 1
        log.error("controller rejected batch %d, dropped: %s", batch.seq, error)

    def _run(self) -> None:
        while not self._stop.is_set():
            delivered = self.send_once()
            if delivered and self.pending():
                continue  # a backlog after an outage: keep sending
            cap = self.backoff_cap_s
            wait = self.interval_s if delivered else backoff_s(self.failures, cap_s=cap)
            self._wake.wait(wait)
            self._wake.clear()

    def start(self) -> Reporter:
        self._thread = threading.Thread(target=self._run, name="slurmft-reporter", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Try to deliver what is left for up to `flush_timeout_s`, then stop."""
        deadline = time.monotonic() + flush_timeout_s
        self._wake.set()
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.transport.timeout_s + 1)
