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

The records are msgspec Structs and are decoded by msgspec's typed JSON decoder: the daemon
parses a batch from every agent every second, and a validating decoder in C costs about 4 µs
per batch where a hand-written one over `json.loads` cost 160 µs (measured: 2,048 batches of 8
ranks, 0.33 s against 0.008 s).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import msgspec

from slurmft.core.kinds import EventKind, FaultClass, NodeRole
from slurmft.errors import SlurmftError
from slurmft.event_schemas import INT32, MAX_MESSAGE, MAX_NODE, details_problem

PROTOCOL_VERSION = 1
BATCH_PATH = "/v1/agent/batch"
TIME_PATH = "/v1/time"
CONTENT_TYPE = "application/json"
# Bounds that keep one batch cheap to parse and store; an agent splits larger backlogs.
MAX_BATCH_ITEMS = 20_000
MAX_BATCH_EVENTS = 1_000  # events become actions: more in one batch are refused one by one
MAX_BODY_BYTES = 8 * 1024 * 1024
# Bounds on the fields (checked by `check_batch`, see "Bounds" in docs/agent.md). Every number
# fits the store's columns (int32 for ranks and steps on PostgreSQL, int64 for sequences), and a
# sequence number stays far from int64's end, so no batch can push a cursor where later batches
# would all read as resends.
MAX_SEQ = 2**62  # exclusive
MAX_WORLD_SIZE = 2**20  # ranks are in [0, MAX_WORLD_SIZE)
# INT32, MAX_NODE and MAX_MESSAGE (slurmft.event_schemas, imported above) bound the rest.
EARLIEST_TIME = 1_577_836_800.0  # 2020-01-01: a time before it is a broken clock, not a report
LATEST_TIME = 4_102_444_800.0  # 2100-01-01; the daemon also refuses times MAX_AHEAD_S ahead
MAX_AHEAD_S = 86_400.0
MAX_RUN_ID = 32  # characters, as the store's columns
MAX_AGENT_ID = 64
MAX_PHASE = 32
MAX_PEER_GROUP = 64
MAX_DETAILS_DEPTH = 16
MAX_DETAILS_SIZE = 1024 * 1024  # characters of strings, plus 8 per value
ITEM_LISTS = ("heartbeats", "step_times", "events")
# The batch step reports its allocation through a reporter of its own; its agent id starts so.
BATCH_STEP_AGENT = "batch-step:"


class ProtocolError(SlurmftError, ValueError):
    """A payload does not follow the wire format; the message names the offending field."""

    exit_code = 2


class CommandKind(StrEnum):
    LEAVE = "leave"  # stop the workers and exit, so a spare takes this node's place
    RESTART_WORKERS = "restart_workers"  # save the workers' stacks, kill them: torchrun restarts


# A finite number: JSON has no NaN, and a number too large for a double (1e999) is refused.
Finite = Annotated[float, msgspec.Meta(ge=-1.7e308, le=1.7e308)]


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A nested record: strict, immutable."""


class _Payload(_Record, frozen=True, tag_field="v", tag=PROTOCOL_VERSION):
    """A top-level payload: carries the protocol version as `v`."""

    def to_json(self) -> bytes:
        # json.dumps, not msgspec's encoder: that writes NaN as null, and an agent must find
        # out here, not from the daemon's refusal.
        return json.dumps(
            msgspec.to_builtins(self), separators=(",", ":"), allow_nan=False
        ).encode()


class RankHeartbeat(_Record, frozen=True):
    """One phase heartbeat of one rank (see slurmft.train.heartbeat)."""

    rank: int
    local_rank: int
    phase: str
    step: int
    progress_age_s: Finite
    deadline_s: Finite
    overdue: bool
    sent_at: Finite
    restart_count: int = 0
    pid: int = 0


class RankStepTime(_Record, frozen=True):
    """One rank's own compute time and collective wait for one step."""

    rank: int
    step: int
    compute_s: Finite
    wait_s: Finite
    ended_at: Finite
    peer_group: str = ""


class AgentEvent(_Record, frozen=True):
    """Something the agent saw or was told by a rank: a hang, a failure, a restart, progress."""

    kind: EventKind
    occurred_at: Finite
    message: str = ""
    rank: int | None = None
    fault_class: FaultClass | None = None
    details: dict[str, Any] = msgspec.field(default_factory=dict)


# A Slurm job id and node name as the store keeps them (attempts.slurm_job_id, *.node).
JobId = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
NodeName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class AllocationMember(_Record, frozen=True):
    node: NodeName
    role: NodeRole = NodeRole.ACTIVE


class AllocationReport(_Record, frozen=True):
    """The batch step's word on its allocation: its Slurm job and the nodes it runs the agent
    step on, with their roles (sent at start and after each relaunch that changes them). Only
    a claim: the daemon checks the job against Slurm (owner, comment, attempt) and stores the
    nodes Slurm says the job holds (slurmft.controller.allocation)."""

    job_id: JobId
    nodes: tuple[AllocationMember, ...]


class AgentBatch(_Payload, frozen=True):
    run_id: str
    agent_id: str  # unique per agent process: seq restarts at 1 with a new agent
    node: str
    seq: int
    sent_at: Finite
    heartbeats: tuple[RankHeartbeat, ...] = ()
    step_times: tuple[RankStepTime, ...] = ()
    events: tuple[AgentEvent, ...] = ()
    # Only the batch step's batches carry it; they get no commands (those are the agents').
    allocation: AllocationReport | None = None

    @classmethod
    def from_json(cls, payload: bytes | str) -> AgentBatch:
        """The batch as decoded, with its header's bounds checked (`check_header`). Raises
        ProtocolError for a batch refused whole, ItemsRefused when only some items are not of
        the wire's types (the bounds of the others are checked by `check_batch`)."""
        if len(payload) > MAX_BODY_BYTES:
            raise ProtocolError(f"batch is {len(payload)} bytes, over {MAX_BODY_BYTES}")
        try:
            batch = _decode(cls, payload, "batch")
        except ProtocolError as error:
            raise _mistyped_items(payload) or error from None
        check_header(batch)
        return batch


class ItemRefusal(_Record, frozen=True):
    """One item of a batch that the daemon will never take: ``items`` names the list
    (heartbeats, step_times, events), ``index`` its place there."""

    items: str
    index: int
    reason: str


class RefusedItems(_Payload, frozen=True):
    """The answer (HTTP 422) to a batch with invalid items: nothing of the batch was stored. The
    agent drops exactly these items and sends the rest again under the same ``seq``."""

    error: str
    refused: tuple[ItemRefusal, ...]

    @classmethod
    def from_json(cls, payload: bytes | str) -> RefusedItems:
        return _decode(cls, payload, "refusal")


class ItemsRefused(ProtocolError):
    """Some items of a batch are invalid (the others are not the reason it is refused)."""

    def __init__(self, refused: Sequence[ItemRefusal]) -> None:
        first = refused[0]
        more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
        super().__init__(
            f"{len(refused)} item(s) refused, nothing stored: {first.reason}{more}; send the "
            "batch again without them"
        )
        self.refused = tuple(refused)

    def reply(self) -> RefusedItems:
        return RefusedItems(error=str(self), refused=self.refused)


class Command(_Record, frozen=True):
    kind: CommandKind
    reason: str = ""


class BatchReply(_Payload, frozen=True):
    acked_seq: int
    server_time: Finite
    commands: tuple[Command, ...] = ()

    @classmethod
    def from_json(cls, payload: bytes | str) -> BatchReply:
        return _decode(cls, payload, "reply")


class TimeReply(_Payload, frozen=True):
    server_time: Finite

    @classmethod
    def from_json(cls, payload: bytes | str) -> TimeReply:
        return _decode(cls, payload, "time")


# --- wire times ----------------------------------------------------------------------------------


def utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


# --- strict parsing -------------------------------------------------------------------------


class _Version(msgspec.Struct):
    v: Any = None


_VERSION = msgspec.json.Decoder(_Version)
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}
_WHERE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD = re.compile(r"^Object (?P<how>missing required|contains unknown) field `(?P<name>[^`]*)`$")

T = TypeVar("T", bound=_Payload)


def _decode(cls: type[T], payload: bytes | str, where: str) -> T:
    _check_version(payload)
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.json.Decoder(cls)
    try:
        decoded: T = decoder.decode(payload)  # the decoder made for cls
    except msgspec.DecodeError as error:  # ValidationError is a DecodeError
        raise _field_error(str(error), where) from None
    except RecursionError:  # JSON nested deeper than the interpreter's stack
        raise ProtocolError(f"{where}: nested too deep to read") from None
    return decoded


def _check_version(payload: bytes | str) -> None:
    """The version is read first (msgspec skips the rest at C speed): a payload of another
    release gets that answer, not a complaint about the first field that changed."""
    try:
        version = _VERSION.decode(payload).v
    except RecursionError:  # JSON nested deeper than the interpreter's stack
        raise ProtocolError("nested too deep to read") from None
    except msgspec.ValidationError as error:
        raise ProtocolError(f"expected a JSON object, {str(error).split(', ', 1)[-1]}") from None
    except msgspec.DecodeError as error:
        raise ProtocolError(f"not JSON: {error}") from None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not {PROTOCOL_VERSION}: agent and daemon must run "
            "the same slurmft release"
        )


def _field_error(message: str, where: str) -> ProtocolError:
    """msgspec's "Expected `int`, got `str` - at `$.heartbeats[0].rank`" as
    "batch.heartbeats[0].rank: expected `int`, got `str`"."""
    match = _WHERE.match(message)
    assert match is not None  # the pattern matches any text
    what, path = match["what"], where + (match["path"] or "")
    field = _FIELD.match(what)
    if field is None:
        return ProtocolError(f"{path}: {what[:1].lower()}{what[1:]}")
    if field["how"] == "missing required":
        return ProtocolError(f"{path}.{field['name']}: missing")
    return ProtocolError(f"{path}: unknown field {field['name']!r}")


# --- bounds ------------------------------------------------------------------------------------
#
# Granularity: a batch whose header (run_id, agent_id, node, seq, sent_at, the item counts) is
# wrong is refused whole (ProtocolError: HTTP 400, the agent drops it). An item that is wrong is
# refused alone (ItemsRefused: HTTP 422 naming it; nothing of the batch is stored, and the
# agent sends the rest again), so one bad event never costs the good heartbeats beside it.


def check_header(batch: AgentBatch, now: float | None = None) -> None:
    """Refuse (ProtocolError) a batch whose header is out of bounds. ``now`` (the daemon's
    clock) also bounds how far ahead ``sent_at`` may be."""
    items = len(batch.heartbeats) + len(batch.step_times) + len(batch.events)
    if batch.allocation is not None:
        items += len(batch.allocation.nodes)
        problem = _text("job_id", batch.allocation.job_id, 32, empty=False) or next(
            (
                problem
                for member in batch.allocation.nodes
                if (problem := _text("node", member.node, MAX_NODE, empty=False)) is not None
            ),
            None,
        )
        if problem is not None:
            raise ProtocolError(f"batch.allocation.{problem}")
    _check_header(batch, items, _latest(now))


def _check_header(batch: AgentBatch | _LooseBatch, items: int, latest: float) -> None:
    problem = (
        _text("run_id", batch.run_id, MAX_RUN_ID, empty=False)
        or _text("agent_id", batch.agent_id, MAX_AGENT_ID, empty=False)
        or _text("node", batch.node, MAX_NODE, empty=False)
        or _whole("seq", batch.seq, 1, MAX_SEQ)
        or _time("sent_at", batch.sent_at, latest)
    )
    if problem is None and items > MAX_BATCH_ITEMS:
        problem = f"holds {items} items, over {MAX_BATCH_ITEMS}: split it"
    if problem is not None:
        raise ProtocolError(f"batch.{problem}")


def check_batch(batch: AgentBatch, now: float | None = None) -> None:
    """Refuse a batch out of bounds: whole (ProtocolError), or the items that are
    (ItemsRefused). What the daemon checks before it stores anything of a batch."""
    check_header(batch, now)
    refused = item_refusals(batch, now)
    if refused:
        raise ItemsRefused(refused)


def item_refusals(batch: AgentBatch, now: float | None = None) -> list[ItemRefusal]:
    latest = _latest(now)
    refused: list[ItemRefusal] = []
    for items, problem_of in _ITEM_CHECKS.items():
        if items == "heartbeats" and _heartbeats_fine(batch.heartbeats, latest):
            continue  # the common case, checked in one pass
        if items == "step_times" and _step_times_fine(batch.step_times, latest):
            continue
        for index, item in enumerate(getattr(batch, items)):
            problem = problem_of(item, latest)
            if problem is not None:
                reason = f"batch.{items}[{index}].{problem}"
            elif items == "events" and index >= MAX_BATCH_EVENTS:
                reason = f"batch.events[{index}]: over the {MAX_BATCH_EVENTS} events of one batch"
            else:
                continue
            refused.append(ItemRefusal(items, index, reason))
    return refused


def _heartbeats_fine(heartbeats: Sequence[RankHeartbeat], latest: float) -> bool:
    """Whether every heartbeat is within bounds: `_heartbeat_problem`'s checks in one pass (a
    third of the cost), without saying which failed."""
    big = 1.7e308
    return all(
        0 <= h.rank < MAX_WORLD_SIZE
        and 0 <= h.local_rank < MAX_WORLD_SIZE
        and -INT32 < h.step < INT32
        and EARLIEST_TIME <= h.sent_at <= latest
        and -big <= h.progress_age_s <= big
        and -big <= h.deadline_s <= big
        and 0 <= h.restart_count < INT32
        and 0 <= h.pid < INT32
        and len(h.phase) <= MAX_PHASE
        and "\x00" not in h.phase
        for h in heartbeats
    )


def _step_times_fine(step_times: Sequence[RankStepTime], latest: float) -> bool:
    """As `_heartbeats_fine`, for `_step_time_problem`."""
    big = 1.7e308
    return all(
        0 <= t.rank < MAX_WORLD_SIZE
        and -INT32 < t.step < INT32
        and EARLIEST_TIME <= t.ended_at <= latest
        and -big <= t.compute_s <= big
        and -big <= t.wait_s <= big
        and len(t.peer_group) <= MAX_PEER_GROUP
        and "\x00" not in t.peer_group
        for t in step_times
    )


def _latest(now: float | None) -> float:
    return LATEST_TIME if now is None else min(LATEST_TIME, now + MAX_AHEAD_S)


def _heartbeat_problem(hb: RankHeartbeat, latest: float) -> str | None:
    return (
        _whole("rank", hb.rank, 0, MAX_WORLD_SIZE)
        or _whole("local_rank", hb.local_rank, 0, MAX_WORLD_SIZE)
        or _text("phase", hb.phase, MAX_PHASE)
        or _whole("step", hb.step, 1 - INT32, INT32)
        or _number("progress_age_s", hb.progress_age_s)
        or _number("deadline_s", hb.deadline_s)
        or _time("sent_at", hb.sent_at, latest)
        or _whole("restart_count", hb.restart_count, 0, INT32)
        or _whole("pid", hb.pid, 0, INT32)
    )


def _step_time_problem(st: RankStepTime, latest: float) -> str | None:
    return (
        _whole("rank", st.rank, 0, MAX_WORLD_SIZE)
        or _whole("step", st.step, 1 - INT32, INT32)
        or _number("compute_s", st.compute_s)
        or _number("wait_s", st.wait_s)
        or _time("ended_at", st.ended_at, latest)
        or _text("peer_group", st.peer_group, MAX_PEER_GROUP)
    )


def _event_problem(event: AgentEvent, latest: float) -> str | None:
    return (
        _time("occurred_at", event.occurred_at, latest)
        or _text("message", event.message, MAX_MESSAGE)
        or (None if event.rank is None else _whole("rank", event.rank, 0, MAX_WORLD_SIZE))
        or _details_problem(event.details)
        or details_problem(event.kind, event.details)
    )


def _whole(name: str, value: int, low: int, high: int) -> str | None:
    """None when ``low <= value < high``."""
    if low <= value < high:
        return None
    return f"{name}: {value} is not in [{low}, {high})"


def _number(name: str, value: float) -> str | None:
    return None if -1.7e308 <= value <= 1.7e308 else f"{name}: {value} is not a finite number"


def _time(name: str, value: float, latest: float) -> str | None:
    if EARLIEST_TIME <= value <= latest:
        return None
    return (
        f"{name}: {value} is not a Unix time between 2020 and a day ahead of the daemon's "
        f"clock ({latest:.0f})"
    )


def _text(name: str, value: str, longest: int, *, empty: bool = True) -> str | None:
    if len(value) > longest:
        return f"{name}: {len(value)} characters, over {longest}"
    if "\x00" in value:
        return f"{name}: holds a NUL character"
    if not empty and not value:
        return f"{name}: empty"
    return None


def _details_problem(details: dict[str, Any]) -> str | None:
    """Event details are free JSON, bounded: depth, size, no NUL, finite numbers, integers in
    int64 (and the Xid and GPU index the store keeps as columns in int32)."""
    for key in ("xid", "gpu_index"):
        value = details.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < INT32:
            return f"details.{key}: {value} is not in [0, {INT32})"
    size = 0
    pending: list[tuple[object, int]] = [(details, 1)]
    while pending:
        value, depth = pending.pop()
        size += 8
        if isinstance(value, dict | list | tuple):
            if depth > MAX_DETAILS_DEPTH:
                return f"details: nested deeper than {MAX_DETAILS_DEPTH}"
            if isinstance(value, dict):
                for key in value:
                    if not isinstance(key, str) or "\x00" in key:
                        return "details: a key that is not text or holds a NUL character"
                    size += len(key)
                pending.extend((inner, depth + 1) for inner in value.values())
            else:
                pending.extend((inner, depth + 1) for inner in value)
        else:
            problem = _scalar_problem(value)
            if problem is not None:
                return f"details: {problem}"
            size += len(value) if isinstance(value, str) else 0
        if size > MAX_DETAILS_SIZE:
            return f"details: over {MAX_DETAILS_SIZE} characters"
    return None


def _scalar_problem(value: object) -> str | None:
    if isinstance(value, str):
        return "a value holds a NUL character" if "\x00" in value else None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, int):  # bool too: in range
        return None if -(2**63) <= value < 2**63 else "an integer out of the int64 range"
    return None if value is None else f"a value of type {type(value).__name__}"


_ITEM_CHECKS: dict[str, Callable[[Any, float], str | None]] = {
    "heartbeats": _heartbeat_problem,
    "step_times": _step_time_problem,
    "events": _event_problem,
}


class _LooseBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A batch whose items are kept undecoded: to tell which of them are of the wrong types."""

    v: int
    run_id: str
    agent_id: str
    node: str
    seq: int
    sent_at: Finite
    heartbeats: tuple[msgspec.Raw, ...] = ()
    step_times: tuple[msgspec.Raw, ...] = ()
    events: tuple[msgspec.Raw, ...] = ()
    allocation: msgspec.Raw | None = None  # checked whole with the header (check_header)


_LOOSE = msgspec.json.Decoder(_LooseBatch)
_ITEM_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "heartbeats": msgspec.json.Decoder(RankHeartbeat),
    "step_times": msgspec.json.Decoder(RankStepTime),
    "events": msgspec.json.Decoder(AgentEvent),
}


def _mistyped_items(payload: bytes | str) -> ItemsRefused | None:
    """When a batch failed to decode only because some items are of the wrong types: those
    items (and any other item out of bounds). None when the batch is wrong as a whole."""
    try:
        loose = _LOOSE.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    if loose.v != PROTOCOL_VERSION:
        return None
    lists = [getattr(loose, items) for items in ITEM_LISTS]
    _check_header(loose, sum(map(len, lists)), LATEST_TIME)
    refused: list[ItemRefusal] = []
    for items, raws in zip(ITEM_LISTS, lists, strict=True):
        decoder = _ITEM_DECODERS[items]
        for index, raw in enumerate(raws):
            try:
                item = decoder.decode(raw)
            except msgspec.DecodeError as error:
                reason = str(_field_error(str(error), f"batch.{items}[{index}]"))
            except RecursionError:
                reason = f"batch.{items}[{index}]: nested too deep to read"
            else:
                problem = _ITEM_CHECKS[items](item, LATEST_TIME)
                if problem is None:
                    continue
                reason = f"batch.{items}[{index}].{problem}"
            refused.append(ItemRefusal(items, index, reason))
    return ItemsRefused(refused) if refused else None
