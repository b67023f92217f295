"""The rank side of the report channel to the node agent.

A rank sends JSON datagrams to a unix datagram socket whose path the agent puts in
`SLURMFT_AGENT_SOCKET`. Sending never blocks and never raises. Linux queues at most
`net.unix.max_dgram_qlen` datagrams (10 by default, whatever the buffer size) on the agent's
socket, and the agent reads it every 0.1 s: the ranks of an 8-GPU node ending a step together
overflow it. So a datagram the kernel refuses for that (EAGAIN) waits in the rank's backlog
(bounded, `BACKLOG`) and goes out, in order, before the next message; only a full backlog drops,
counted. When the agent is absent the message is dropped and counted, and for one second sends
are dropped without a system call. A step must never wait on telemetry. The schema is
documented in docs/train.md.

This module does not import torch: the agent may import it to share the schema constants.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
SOCKET_ENV = "SLURMFT_AGENT_SOCKET"
# The rendezvous round the workers were started in, set by slurmft's launcher (agent.rounds).
RDZV_ROUND_ENV = "SLURMFT_RDZV_ROUND"
# A file the launcher writes when its node was declared dead by its peers (a frozen node that
# ran again, slurmft.agent.peer_detector): a worker that sees it commits no checkpoint.
FENCE_FILE_ENV = "SLURMFT_FENCE_FILE"
# The node's in-memory snapshots (slurmft.train.snapshot): a tmpfs folder the agent owns.
SNAPSHOT_DIR_ENV = "SLURMFT_SNAPSHOT_DIR"


def node_fenced() -> bool:
    path = os.environ.get(FENCE_FILE_ENV, "")
    return bool(path) and os.path.exists(path)
# A unix datagram larger than the socket's send buffer fails with EMSGSIZE; staying well under the
# Linux default (212992 bytes) keeps every message deliverable. Larger messages are dropped.
MAX_MESSAGE_BYTES = 64 * 1024

# No agent listening: retrying every call would cost a failed system call per step for nothing.
_ABSENT_ERRNOS = {errno.ENOENT, errno.ECONNREFUSED, errno.ENOTCONN}
ABSENT_RETRY_S = 1.0

# The agent is there but has not read yet: the datagram waits in the backlog.
_BUSY_ERRNOS = {errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS}
# Datagrams waiting for the agent to read; past this the newest is dropped (a rank whose agent
# stopped reading must not grow without end).
BACKLOG = 1024

# errnos that mean "no agent listening" or a message it cannot take: drop, never raise.
_DROP_ERRNOS = {
    errno.ENOENT,
    errno.ECONNREFUSED,
    errno.ENOTCONN,
    errno.EMSGSIZE,
    errno.EPIPE,
    errno.EACCES,
}


@dataclass
class ChannelStats:
    """Counters a script may log at exit; `dropped` > 0 with an agent present means it lags."""

    sent: int = 0
    dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1


def rank_identity() -> dict[str, Any]:
    """The fields torchrun sets that identify this process; every message carries them."""
    env = os.environ
    return {
        "rank": int(env.get("RANK", "0")),
        "local_rank": int(env.get("LOCAL_RANK", "0")),
        "world_size": int(env.get("WORLD_SIZE", "1")),
        "run_id": env.get("TORCHELASTIC_RUN_ID", ""),
        "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "rdzv_round": rdzv_round(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }


def rdzv_round() -> int | None:
    """The rendezvous round these workers were started in (slurmft's launcher sets it), or
    None under a plain torchrun."""
    text = os.environ.get(RDZV_ROUND_ENV, "")
    return int(text) if text.isdigit() else None


class ReportChannel:
    """Non-blocking, lossy sender of JSON messages to the node agent.

    `send(kind, **fields)` adds the envelope (`v`, `kind`, `time`, identity) and returns True if
    the datagram was handed to the kernel. Thread-safe enough for the heartbeat thread and the
    training loop to share: each `sendto` is one system call on a socket no one reads from.
    """

    def __init__(self, socket_path: str | None = None, identity: dict[str, Any] | None = None):
        self.socket_path = socket_path if socket_path is not None else os.environ.get(SOCKET_ENV)
        self.identity = identity if identity is not None else rank_identity()
        self.stats = ChannelStats()
        self._sock: socket.socket | None = None
        self._retry_at = 0.0  # while the agent is absent, sends before this time are dropped
        # Datagrams the agent's full queue refused, oldest first; the lock keeps their order
        # between the heartbeat thread and the training loop.
        self._backlog: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        if self.socket_path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def encode(self, kind: str, fields: dict[str, Any]) -> bytes:
        message = {"v": SCHEMA_VERSION, "kind": kind, "time": time.time(), **self.identity}
        message.update(fields)
        return json.dumps(message, separators=(",", ":")).encode()

    def send(self, kind: str, **fields: Any) -> bool:
        """Hand the message to the kernel, or to the backlog behind earlier ones; False when
        it was dropped."""
        if self._sock is None or self.socket_path is None:  # the socket exists only with a path
            # No agent configured: the cheapest path, taken by plain torchrun runs.
            self.stats.drop("no_socket")
            return False
        if self._retry_at and time.monotonic() < self._retry_at:
            self.stats.drop("agent_absent")
            return False
        payload = self.encode(kind, fields)
        if len(payload) > MAX_MESSAGE_BYTES:
            self.stats.drop("too_large")
            return False
        with self._lock:
            if self._flush_backlog():
                return self._send_now(payload)
            return self._hold(payload)

    def flush(self, timeout_s: float = 0.0) -> int:
        """Send what waits in the backlog while the agent takes it, retrying for up to
        ``timeout_s`` (at a rank's end: its last reports must not die with it); how many still
        wait."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._flush_backlog()
                waiting = len(self._backlog)
            if not waiting or time.monotonic() >= deadline:
                return waiting
            time.sleep(0.01)

    def _flush_backlog(self) -> bool:
        """True when the backlog is empty."""
        while self._backlog:
            outcome = self._sendto(self._backlog[0])
            if outcome == "busy":
                return False
            self._backlog.popleft()
            if self._retry_at:  # the agent is gone: what waited for it goes too
                for _ in range(len(self._backlog)):
                    self.stats.drop("agent_absent")
                self._backlog.clear()
        return True

    def _send_now(self, payload: bytes) -> bool:
        outcome = self._sendto(payload)
        if outcome == "busy":
            return self._hold(payload)
        return outcome == "sent"

    def _hold(self, payload: bytes) -> bool:
        if len(self._backlog) >= BACKLOG:
            self.stats.drop("backlog_full")
            return False
        self._backlog.append(payload)
        return True

    def _sendto(self, payload: bytes) -> str:
        """"sent", "busy" (the agent has not read yet: try again later) or "dropped"."""
        assert self._sock is not None and self.socket_path is not None
        try:
            self._sock.sendto(payload, self.socket_path)
        except OSError as error:
            if error.errno in _BUSY_ERRNOS:
                return "busy"
            if error.errno in _ABSENT_ERRNOS:
                self._retry_at = time.monotonic() + ABSENT_RETRY_S
            name = errno.errorcode.get(error.errno or 0, "oserror")
            self.stats.drop(name if error.errno in _DROP_ERRNOS else "oserror")
            return "dropped"
        self._retry_at = 0.0
        self.stats.sent += 1
        return "sent"

    def close(self) -> None:
        if self._sock is not None:
            self.flush()
            self._sock.close()
            self._sock = None


def decode(payload: bytes) -> dict[str, Any]:
    """Parse one datagram (the agent's side); raises ValueError on a foreign schema version."""
    message = json.loads(payload)
    if not isinstance(message, dict) or message.get("v") != SCHEMA_VERSION:
        raise ValueError(f"unsupported report message: {payload[:80]!r}")
    return message
