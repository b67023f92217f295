"""Group commit: the agent batches that arrive together are stored in one transaction.

Every agent posts a batch every second, so a daemon watching 2,048 nodes answers 2,000 requests
a second. One transaction per request costs a handful of statements each (authorize, cursor,
heartbeats, step times, commands), and the statements, not the rows, are the cost: measured
with 16,384 ranks, 1.5 ms of daemon CPU per batch on SQLite, 3 s per second of reports.

So the request threads hand their parsed batch to one writer thread and wait. The writer takes
everything queued, stores it with `ingest_batches` (a constant number of statements per group),
commits, and only then answers each request: an agent is acknowledged only for what is durable.
There is no added delay: under light load a group is one batch, and groups grow by themselves
while a commit is in progress (the classic group commit of database logs).

Every batch is checked (token, bounds, its run's ingest rate) before the group is written, so
a malformed batch is refused alone and writes nothing: it never fails the group's transaction.
A group that fails all the same (a store error nobody foresaw) for any reason but an
unreachable store is retried one batch at a time, so one bad batch is refused alone and its
neighbours are stored.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from slurmft.controller.ingest import RESTART_COMMAND_TTL, IngestRefused, ingest_batches
from slurmft.controller.limits import AuditThrottle, IngestLimiter
from slurmft.db import Database, DatabaseUnavailable
from slurmft.protocol import AgentBatch, BatchReply

log = logging.getLogger(__name__)

# Bounds one transaction: its rows and the time a lock on the store is held.
MAX_GROUP_BATCHES = 512
# A request gives up waiting after this long (the agent resends; the batch is idempotent).
ANSWER_TIMEOUT_S = 60.0


@dataclass
class _Post:
    batch: AgentBatch
    token: str
    answer: Future[BatchReply] = field(default_factory=Future)


_STOP = object()


class GroupCommitter:
    """One writer thread storing the batches handed to `submit` by request threads."""

    def __init__(
        self,
        database: Database,
        *,
        clock: Callable[[], datetime],
        sample_every: timedelta,
        max_group: int = MAX_GROUP_BATCHES,
        restart_ttl: timedelta = RESTART_COMMAND_TTL,
        limiter: IngestLimiter | None = None,
    ) -> None:
        self.database = database
        self.clock = clock
        self.sample_every = sample_every
        self.restart_ttl = restart_ttl
        self.max_group = max_group
        self.limiter = limiter
        self._audit = AuditThrottle()
        # A test hook: the writer takes a first batch, then waits here while this is clear, so
        # a test can queue what it wants in one group behind it (`hold`).
        self._go = threading.Event()
        self._go.set()
        self.holding = threading.Event()  # set while the writer waits at the hook
        self._queue: queue.SimpleQueue[_Post | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="slurmft-ingest-writer", daemon=True)
        self._stopped = threading.Event()
        # Held around "not stopped? then queue" and "stopped, then the stop marker": a post is
        # either queued before the marker (stored, or answered by stop) or refused, never left
        # behind the marker for nobody to answer.
        self._accepting = threading.Lock()
        self.groups = 0  # committed groups, for tests and the benchmark
        self.batches = 0
        self.fallbacks = 0  # groups that failed and were stored one batch at a time

    def start(self) -> GroupCommitter:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Store what is queued, then stop; later submits are answered 'retry later'."""
        with self._accepting:
            if self._stopped.is_set():
                return
            self._stopped.set()
            self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join()
        while True:  # what a writer that never ran, or died, left queued: answered, not dropped
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Post):
                item.answer.set_exception(DatabaseUnavailable("the daemon is stopping"))

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """For tests: while inside, the writer holds the first batch it takes (``holding`` is
        then set) and writes nothing; on leaving, it takes everything queued as one group."""
        self._go.clear()
        try:
            yield
        finally:
            self._go.set()

    def queued(self) -> int:
        """Batches waiting for the writer."""
        return self._queue.qsize()

    def submit(
        self, batch: AgentBatch, token: str, timeout_s: float = ANSWER_TIMEOUT_S
    ) -> BatchReply:
        """Store ``batch`` (or find it already stored) and return the agent's reply once its
        transaction committed. Raises IngestRefused, or DatabaseUnavailable: retry later."""
        post = _Post(batch, token)
        with self._accepting:
            if self._stopped.is_set():
                raise DatabaseUnavailable("the daemon is stopping")
            self._queue.put(post)
        try:
            return post.answer.result(timeout=timeout_s)
        except FutureTimeout:
            raise DatabaseUnavailable(
                f"the store did not take the batch within {timeout_s:g} s"
            ) from None

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            if not self._go.is_set():
                self.holding.set()
                self._go.wait()
                self.holding.clear()
            group = [first]
            stop = False
            while len(group) < self.max_group:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                group.append(item)
            self._commit([post for post in group if isinstance(post, _Post)])
            if stop:
                return

    def _commit(self, group: Sequence[_Post]) -> None:
        try:
            with self.database.session() as session:
                results = ingest_batches(
                    session,
                    [(post.batch, post.token) for post in group],
                    now=self.clock(),
                    sample_every=self.sample_every,
                    restart_ttl=self.restart_ttl,
                    limiter=self.limiter,
                    audit=self._audit,
                )
        except DatabaseUnavailable as error:  # every batch would fail alike: say so at once
            for post in group:
                post.answer.set_exception(error)
            return
        except Exception as error:
            if len(group) == 1:
                group[0].answer.set_exception(error)
                return
            log.warning(
                "a group of %d batches failed (%s); storing them one by one", len(group), error
            )
            self.fallbacks += 1
            for post in group:
                self._commit([post])
            return
        self.groups += 1
        self.batches += len(group)
        for post, result in zip(group, results, strict=True):
            if isinstance(result, IngestRefused):
                post.answer.set_exception(result)
            else:
                post.answer.set_result(result)
