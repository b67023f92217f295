"""The agent's end of the ranks' report channel (sender: slurmft.train.report).

Ranks send JSON datagrams to a unix datagram socket whose path the agent puts in
SLURMFT_AGENT_SOCKET. The agent binds it, drains it without blocking, and turns each message
into a wire-format record (slurmft.protocol). A malformed datagram is counted and skipped: a
rank's bug must not stop the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from slurmft.core.kinds import EventKind, FaultClass
from slurmft.protocol import AgentEvent, RankHeartbeat, RankStepTime
from slurmft.train.report import MAX_MESSAGE_BYTES, decode

log = logging.getLogger(__name__)

PEER_DEAD_MESSAGE = "peer_dead"
# From this node's launcher (slurmft.agent.peer_detector): the rendezvous store stopped
# answering, or answers again.
STORE_FAILED_MESSAGE = "store_failed"
STORE_BACK_MESSAGE = "store_back"
# A burst of heartbeats from many local ranks must not overflow the kernel queue.
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024

# Rank events (slurmft.train) and what they are to the daemon. Others are counted, not sent.
RANK_EVENT_KINDS: dict[str, tuple[EventKind, FaultClass | None]] = {
    # A peer died or a collective timed out: evidence about *another* rank, never a failure of
    # this one (counting it would make every survivor of a node loss look like a lemon).
    "collective_error": (EventKind.COLLECTIVE_ERROR, None),
    "checkpoint_saved": (EventKind.CHECKPOINT, None),
    "checkpoint_invalid": (EventKind.RANK_FAILURE, FaultClass.INFRASTRUCTURE),
    # Its class is the re-run's verdict (`_numerical_class`): numerical, or this node's hardware.
    "numerical_fault": (EventKind.NUMERICAL_FAULT, FaultClass.NUMERICAL),
}
_ENVELOPE = {"v", "kind", "time", "rank", "local_rank", "world_size", "run_id", "restart_count",
             "rdzv_round", "pid", "host"}


@dataclass(frozen=True)
class RendezvousRound:
    """torchrun joined rendezvous round `round`, leaving `previous` (None: its first round);
    sent by slurmft's launcher (slurmft.agent.rounds), for the agent alone."""

    round: int
    previous: int | None
    at: float


@dataclass(frozen=True)
class StoreHealth:
    """The launcher found the rendezvous store failing (``failed``, with its error) or
    answering again, at ``at``; for the agent alone: a store that fails and comes back (a
    restart under its supervisor) is no event, but one whose failure ends torchrun dates that
    failure."""

    failed: bool
    at: float
    error: str = ""


Record = RankHeartbeat | RankStepTime | AgentEvent | RendezvousRound | StoreHealth


def _round_number(value: Any) -> int | None:
    """A round number as sent, or None; a bool or a negative number is no round."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a rendezvous round: {value!r}")
    return value


@dataclass
class ChannelCounters:
    received: int = 0
    malformed: int = 0
    ignored: dict[str, int] = field(default_factory=dict)


def to_record(message: dict[str, Any]) -> Record | None:
    """One decoded rank message as a wire record; None for kinds the daemon does not take."""
    kind = message["kind"]
    if kind == "heartbeat":
        return RankHeartbeat(
            rank=int(message["rank"]),
            local_rank=int(message["local_rank"]),
            phase=str(message["phase"]),
            step=int(message["step"]),
            progress_age_s=float(message["progress_age_s"]),
            deadline_s=float(message["deadline_s"]),
            overdue=bool(message["overdue"]),
            sent_at=float(message["time"]),
            restart_count=int(message.get("restart_count", 0)),
            pid=int(message.get("pid", 0)),
        )
    if kind == "step":
        return RankStepTime(
            rank=int(message["rank"]),
            step=int(message["step"]),
            compute_s=float(message["compute_s"]),
            wait_s=float(message["wait_s"]),
            ended_at=float(message["time"]),
        )
    if kind == "straggler":
        details = {k: v for k, v in message.items() if k not in _ENVELOPE}
        return AgentEvent(
            kind=EventKind.STRAGGLER,
            occurred_at=float(message["time"]),
            message=f"rank {message['straggler_rank']} is {message['ratio']:.2f}x its peers",
            rank=int(message["straggler_rank"]),
            fault_class=FaultClass.STRAGGLER,
            details=details,
        )
    if kind == "round":
        joined = _round_number(message["round"])
        if joined is None:
            raise ValueError("a round message without its round")
        previous = _round_number(message.get("previous"))
        return RendezvousRound(joined, previous, float(message["time"]))
    if kind in (STORE_FAILED_MESSAGE, STORE_BACK_MESSAGE):
        failed = kind == STORE_FAILED_MESSAGE
        error = str(message.get("error", ""))[:500] if failed else ""
        return StoreHealth(failed, float(message["time"]), error)
    if kind == PEER_DEAD_MESSAGE:  # from this node's launcher (slurmft.agent.peer_detector)
        return AgentEvent(
            kind=EventKind.PEER_DEAD,
            occurred_at=float(message["time"]),
            message=str(message["reason"])[:500],
            details={"peer": str(message["peer"]), "silent_s": float(message["silent_s"])},
        )
    if kind == "event" and message.get("event") in RANK_EVENT_KINDS:
        if message["event"] == "checkpoint_saved" and int(message["rank"]) != 0:
            return None  # every rank saves its shard; one event per checkpoint is the progress
        event_kind, fault_class = RANK_EVENT_KINDS[message["event"]]
        text = str(message["event"])
        if event_kind is EventKind.NUMERICAL_FAULT:
            fault_class = _numerical_class(message)
            text = str(message.get("summary") or text)[:500]
        details = {k: v for k, v in message.items() if k not in _ENVELOPE}
        worker_round = _round_number(message.get("rdzv_round"))
        if worker_round is not None:
            details["rdzv_round"] = worker_round  # the agent names it in its step (round_key)
        return AgentEvent(
            kind=event_kind,
            occurred_at=float(message["time"]),
            message=text,
            rank=int(message["rank"]),
            fault_class=fault_class,
            details=details,
        )
    return None


def _numerical_class(message: dict[str, Any]) -> FaultClass:
    """A numerical fault its re-run reproduced is the data's or the model's; one it did not is
    a suspected hardware fault of the reporting rank's node."""
    return FaultClass.NUMERICAL if message.get("reproduced") is not False else FaultClass.HARDWARE


class RankChannelServer:
    """Binds the node-local socket; `drain()` returns what arrived since the last call."""

    def __init__(self, path: str):
        self.path = path
        self.counters = ChannelCounters()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        self._sock.bind(path)
        os.chmod(path, 0o600)  # only the job's user may report
        self._sock.setblocking(False)

    def drain(self, limit: int = 10_000) -> list[Record]:
        """What arrived since the last call, as wire records; other kinds are counted."""
        out: list[Record] = []
        for _ in range(limit):
            try:
                payload = self._sock.recv(MAX_MESSAGE_BYTES + 1)
            except BlockingIOError:
                break
            self.counters.received += 1
            try:
                message = decode(payload)
                record = to_record(message)
            except (ValueError, KeyError, TypeError) as error:
                self.counters.malformed += 1
                log.debug("malformed rank message %r: %s", payload[:120], error)
                continue
            if record is None:
                name = str(message.get("event") or message.get("kind"))
                self.counters.ignored[name] = self.counters.ignored.get(name, 0) + 1
            else:
                out.append(record)
        return out

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
