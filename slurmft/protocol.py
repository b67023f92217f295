"""The agent ↔ daemon wire format: one module both sides use, so they cannot drift.

An agent POSTs an `AgentBatch` as JSON to `BATCH_PATH` with `Authorization: Bearer <run token>`.
Each batch carries the agent's sequence number; the agent resends the same batch (same `seq`)
until it is acknowledged, so the daemon must treat (`run_id`, `agent_id`, `seq`) as idempotent.
The reply is a `BatchReply`: the acknowledged `seq`, the daemon's clock, and commands for the
agent (for example `leave`: this node is cordoned). `GET TIME_PATH` returns a `TimeReply`, which
the agent's preflight uses to measure clock skew (rendezvous keep-alive expiry compares wall
clocks across nodes).

Times on the wire are Unix seconds as floats. Every payload carries `v` = `PROTOCOL_VERSION`;
parsing is strict: a missing, extra or mistyped field raises `ProtocolError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar

from slurmft.db.ingest import HeartbeatReport, StepTimeReport
from slurmft.db.models import EventKind, FaultClass
from slurmft.errors import SlurmftError

PROTOCOL_VERSION = 1
BATCH_PATH = "/v1/agent/batch"
TIME_PATH = "/v1/time"
CONTENT_TYPE = "application/json"
# Bounds that keep one batch cheap to parse and store; an agent splits larger backlogs.
MAX_BATCH_ITEMS = 20_000
MAX_BODY_BYTES = 8 * 1024 * 1024


class ProtocolError(SlurmftError, ValueError):
    """A payload does not follow the wire format; the message names the offending field."""

    exit_code = 2


class CommandKind(StrEnum):
    LEAVE = "leave"  # stop the workers and exit, so a spare takes this node's place
    RESTART_WORKERS = "restart_workers"  # save the workers' stacks, kill them: torchrun restarts


@dataclass(frozen=True)
class RankHeartbeat:
    """One phase heartbeat of one rank (see slurmft.train.heartbeat)."""

    rank: int
    local_rank: int
    phase: str
    step: int
    progress_age_s: float
    deadline_s: float
    overdue: bool
    sent_at: float
    restart_count: int = 0
    pid: int = 0


@dataclass(frozen=True)
class RankStepTime:
    """One rank's own compute time and collective wait for one step."""

    rank: int
    step: int
    compute_s: float
    wait_s: float
    ended_at: float
    peer_group: str = ""


@dataclass(frozen=True)
class AgentEvent:
    """Something the agent saw or was told by a rank: a hang, a failure, a restart, progress."""

    kind: str  # an EventKind value
    occurred_at: float
    message: str = ""
    rank: int | None = None
    fault_class: str | None = None  # a FaultClass value
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentBatch:
    run_id: str
    agent_id: str  # unique per agent process: seq restarts at 1 with a new agent
    node: str
    seq: int
    sent_at: float
    heartbeats: tuple[RankHeartbeat, ...] = ()
    step_times: tuple[RankStepTime, ...] = ()
    events: tuple[AgentEvent, ...] = ()

    def to_json(self) -> bytes:
        return _dump(self)

    @classmethod
    def from_json(cls, payload: bytes | str) -> AgentBatch:
        if len(payload) > MAX_BODY_BYTES:
            raise ProtocolError(f"batch is {len(payload)} bytes, over {MAX_BODY_BYTES}")
        batch = _parse(cls, _load(payload), "batch")
        items = len(batch.heartbeats) + len(batch.step_times) + len(batch.events)
        if items > MAX_BATCH_ITEMS:
            raise ProtocolError(f"batch holds {items} items, over {MAX_BATCH_ITEMS}")
        if batch.seq < 1:
            raise ProtocolError(f"batch.seq: must be at least 1, got {batch.seq}")
        return batch


@dataclass(frozen=True)
class Command:
    kind: str  # a CommandKind value
    reason: str = ""


@dataclass(frozen=True)
class BatchReply:
    acked_seq: int
    server_time: float
    commands: tuple[Command, ...] = ()

    def to_json(self) -> bytes:
        return _dump(self)

    @classmethod
    def from_json(cls, payload: bytes | str) -> BatchReply:
        return _parse(cls, _load(payload), "reply")


@dataclass(frozen=True)
class TimeReply:
    server_time: float

    def to_json(self) -> bytes:
        return _dump(self)

    @classmethod
    def from_json(cls, payload: bytes | str) -> TimeReply:
        return _parse(cls, _load(payload), "time")


# --- conversion to what the store writes ---------------------------------------------------------


def utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def heartbeat_reports(batch: AgentBatch) -> list[HeartbeatReport]:
    """The store's heartbeat rows. `seq` is the send time in microseconds, not the batch seq:
    when a spare takes over a rank, its agent's batch numbers start again at 1, but the rank's
    newest heartbeat must still win (clock skew between nodes is checked to stay under 1 s)."""
    return [
        HeartbeatReport(
            rank=hb.rank,
            node=batch.node,
            phase=hb.phase,
            step=hb.step,
            seq=round(hb.sent_at * 1_000_000),
            sent_at=utc(hb.sent_at),
            progress_age_s=hb.progress_age_s,
            deadline_s=hb.deadline_s,
        )
        for hb in batch.heartbeats
    ]


def step_time_reports(batch: AgentBatch) -> list[StepTimeReport]:
    return [
        StepTimeReport(
            rank=st.rank,
            step=st.step,
            compute_s=st.compute_s,
            wait_s=st.wait_s,
            ended_at=utc(st.ended_at),
            peer_group=st.peer_group,
        )
        for st in batch.step_times
    ]


# --- strict parsing -------------------------------------------------------------------------


def _dump(record: Any) -> bytes:
    body = {"v": PROTOCOL_VERSION, **dataclasses.asdict(record)}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _load(payload: bytes | str) -> dict[str, Any]:
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"expected a JSON object, got {type(data).__name__}")
    version = data.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not {PROTOCOL_VERSION}: agent and daemon must run "
            "the same slurmft release"
        )
    return data


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _float(value: Any) -> bool:
    return (_int(value) or isinstance(value, float)) and math.isfinite(value)


_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("a whole number", _int),
    "float": ("a finite number", _float),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int | None": ("a whole number or null", lambda v: v is None or _int(v)),
    "str | None": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "dict[str, Any]": ("an object", lambda v: isinstance(v, dict)),
}
_NESTED: dict[str, type] = {
    "tuple[RankHeartbeat, ...]": RankHeartbeat,
    "tuple[RankStepTime, ...]": RankStepTime,
    "tuple[AgentEvent, ...]": AgentEvent,
    "tuple[Command, ...]": Command,
}
# Fields whose strings must come from a closed set.
_CHOICES: dict[tuple[type, str], frozenset[str]] = {
    (AgentEvent, "kind"): frozenset(EventKind),
    (AgentEvent, "fault_class"): frozenset(FaultClass),
    (Command, "kind"): frozenset(CommandKind),
}

T = TypeVar("T")


def _parse(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    extra = sorted(set(data) - set(fields))
    if extra:
        raise ProtocolError(f"{where}: unknown field {extra[0]!r}")
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        path = f"{where}.{name}"
        if name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{path}: missing")
            continue
        values[name] = _value(cls, name, str(spec.type), data[name], path)
    return cls(**values)


def _value(cls: type, name: str, annotation: str, raw: Any, path: str) -> Any:
    nested = _NESTED.get(annotation)
    if nested is not None:
        if not isinstance(raw, list):
            raise ProtocolError(f"{path}: expected a list, got {type(raw).__name__}")
        return tuple(
            _parse(nested, _object(item, f"{path}[{i}]"), f"{path}[{i}]")
            for i, item in enumerate(raw)
        )
    description, check = _CHECKS[annotation]
    if not check(raw):
        raise ProtocolError(f"{path}: expected {description}, got {raw!r:.60}")
    choices = _CHOICES.get((cls, name))
    if choices is not None and raw is not None and raw not in choices:
        raise ProtocolError(f"{path}: {raw!r} is not one of {', '.join(sorted(choices))}")
    return float(raw) if annotation == "float" else raw


def _object(raw: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ProtocolError(f"{path}: expected an object, got {type(raw).__name__}")
    return raw
