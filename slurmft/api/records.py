"""What the daemon answers about runs, typed: the structures of `slurmft runs --json`,
`slurmft status --json` and `slurmft events --json`.

Each record keeps the daemon's answer as it came (``to_dict()`` gives it back, so the CLI's
``--json`` prints exactly what the daemon said) and offers its fields typed: states as
`RunState`, times as aware datetimes, lists as tuples. A field a newer daemon adds is kept in
``to_dict()``; one an older daemon lacks reads None.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, ClassVar, Self, TypeVar

from slurmft.core.states import RunState


def _time(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(value or ())


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(value or ())


@dataclass(frozen=True, kw_only=True)
class Record:
    """One object of the daemon's answer, typed; ``raw`` is the object itself."""

    raw: Mapping[str, Any] = field(repr=False, compare=False)
    # How this record reads a field unlike every other record (the shared ways: _CONVERT).
    OWN_CONVERT: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        convert = {**_CONVERT, **cls.OWN_CONVERT}
        typed = {
            f.name: convert.get(f.name, _same)(data.get(f.name))
            for f in fields(cls)
            if f.name != "raw"
        }
        return cls(raw=data, **typed)

    def to_dict(self) -> dict[str, Any]:
        """The daemon's answer as it came (a copy): the `--json` structure."""
        return copy.deepcopy(dict(self.raw))


@dataclass(frozen=True, kw_only=True)
class ActionRecord(Record):
    """Something slurmft did for a run (an action row), with its reason."""

    at: datetime
    kind: str  # drain, agent_leave, requeue, resubmit, notify, ...
    node: str | None
    status: str  # planned, done, failed, skipped
    reason: str
    error: str | None


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Record):
    """The newest checkpoint reported: verified by slurmft.train (a step) or found complete on
    disk by the batch step (a label)."""

    at: datetime
    age_s: float
    step: int | None
    label: str
    verified: bool


@dataclass(frozen=True, kw_only=True)
class EffectiveTime(Record):
    """The run's row of the `run_effective_time` view (docs/failure-history.md)."""

    wall_s: float
    lost_s: float
    ratio: float | None


@dataclass(frozen=True, kw_only=True)
class RunSummary(Record):
    """One run as `slurmft runs` shows it."""

    run_id: str
    name: str
    owner: str
    state: RunState
    nodes: int
    spares: int
    job_id: str | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    end_reason: str | None
    cancel_requested: bool
    step: int | None  # None: the script reports no steps (node-level supervision)
    world_size: int | None
    restarts: int  # restarts without progress, against restart_cap
    restart_cap: int
    effective_ratio: float | None
    spares_left: int | None

    @property
    def ended(self) -> bool:
        return self.state.is_terminal


@dataclass(frozen=True, kw_only=True)
class RunStatus(RunSummary):
    """One run as `slurmft status RUN` shows it."""

    last_heartbeat_at: datetime | None
    checkpoint: Checkpoint | None
    effective: EffectiveTime | None
    doing: str  # what slurmft is doing for the run now, in words
    # Passes in a row in which the daemon's control pass failed for this run, and the newest
    # failure; held (only a cancel carried out) from three on (slurmft.controller.pass_health).
    control_failures: int
    control_error: str | None
    held: bool
    excluded_nodes: tuple[str, ...]
    recent_actions: tuple[ActionRecord, ...]
    human_needed: tuple[ActionRecord, ...]  # notices that ask a person to act


@dataclass(frozen=True, kw_only=True)
class TimelineEntry(Record):
    """One line of a run's timeline: an event (what happened) or an action (what slurmft did);
    one thing reported by many ranks or nodes is one entry with their count."""

    OWN_CONVERT: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"nodes": _strings}

    at: datetime
    source: str  # "event" or "action"
    kind: str
    text: str
    status: str | None
    fault_class: str | None
    xid: int | None
    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    count: int
    reporter: str


@dataclass(frozen=True, kw_only=True)
class EventPage(Record):
    """One answer of `events`: entries in time order, and the cursor to ask after."""

    run_id: str
    state: RunState
    entries: tuple[TimelineEntry, ...]
    cursor: Mapping[str, int]  # opaque: hand it back to ask for what came after
    truncated: bool  # more were there than the limit


R = TypeVar("R", bound=Record)


def _records(kind: type[R]) -> Callable[[Any], tuple[R, ...]]:
    return lambda value: tuple(kind.from_dict(item) for item in value or ())


def _record(kind: type[R]) -> Callable[[Any], R | None]:
    return lambda value: None if value is None else kind.from_dict(value)


def _same(value: Any) -> Any:
    return value


# How each field is read from JSON, by name, in every record (one that differs: OWN_CONVERT).
_CONVERT: dict[str, Callable[[Any], Any]] = {
    "state": RunState,
    "at": _time,
    "created_at": _time,
    "started_at": _time,
    "ended_at": _time,
    "last_heartbeat_at": _time,
    "checkpoint": _record(Checkpoint),
    "effective": _record(EffectiveTime),
    "excluded_nodes": _strings,
    "ranks": _ints,
    "recent_actions": _records(ActionRecord),
    "human_needed": _records(ActionRecord),
    "entries": _records(TimelineEntry),
}
