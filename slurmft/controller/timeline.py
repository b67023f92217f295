"""A run's story as one timeline: what happened (events) and what slurmft did (actions),
interleaved in time order, for `slurmft events RUN [--follow]`.

Many reports of one thing arrive once per rank or per node (every agent's "workers restarted
(rendezvous round 2 -> 3)", every rank's collective error): consecutive entries of the same
kind and message within ``GROUP_S`` of the first are one line with their count and the nodes
and ranks they came from.

``--follow`` asks again with the newest ids it has seen (``cursor``), so nothing recorded in
between is missed or shown twice, whatever the clocks of the reporting nodes say.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.db.models import Action, Event

GROUP_S = 30.0  # a restart's reports from 2,048 nodes arrive within seconds of each other
MAX_ENTRIES = 10_000  # of each, per answer (the socket's reply stays small)


@dataclass(frozen=True)
class Entry:
    at: datetime
    source: str  # "event" or "action"
    kind: str
    text: str  # an event's message; an action's reason (and error, if it failed)
    status: str | None = None  # an action's
    fault_class: str | None = None
    xid: int | None = None
    nodes: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    count: int = 1
    reporter: str = ""  # an event's source: the daemon, an agent, the batch step

    def absorbs(self, other: Entry, window: timedelta) -> bool:
        """``other`` is the same thing told by another node or rank (a reporter already in the
        group telling it again is news: the next checkpoint, the next restart)."""
        return (
            self.source == other.source == "event"
            and (self.kind, self.text, self.reporter) == (other.kind, other.text, other.reporter)
            and other.at - self.at <= window
            and not set(other.reporters) & set(self.reporters)
        )

    @property
    def reporters(self) -> tuple[int | str, ...]:
        """Who told it: its ranks, or its nodes for a node's report."""
        return self.ranks or self.nodes

    def merged(self, other: Entry) -> Entry:
        return replace(
            self,
            count=self.count + other.count,
            nodes=tuple(sorted({*self.nodes, *other.nodes})),
            ranks=tuple(sorted({*self.ranks, *other.ranks})),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "source": self.source,
            "kind": self.kind,
            "text": self.text,
            "status": self.status,
            "fault_class": self.fault_class,
            "xid": self.xid,
            "nodes": list(self.nodes),
            "ranks": list(self.ranks),
            "count": self.count,
            "reporter": self.reporter,
        }


@dataclass(frozen=True)
class Cursor:
    """The newest event and action ids a reader has seen."""

    event_id: int = 0
    action_id: int = 0

    @classmethod
    def from_json(cls, data: object) -> Cursor:
        if not isinstance(data, dict):
            raise ValueError("a cursor is an object: {event_id, action_id}")
        ids = (data.get("event_id", 0), data.get("action_id", 0))
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError("a cursor holds two whole numbers, event_id and action_id")
        return cls(*ids)

    def to_json(self) -> dict[str, int]:
        return {"event_id": self.event_id, "action_id": self.action_id}


@dataclass(frozen=True)
class Timeline:
    entries: tuple[Entry, ...]
    cursor: Cursor
    # More than ``limit`` were there: the older ones left out, or (after a cursor) the newer
    # ones left for the next ask.
    truncated: bool = field(default=False)


def _event_entry(event: Event) -> Entry:
    return Entry(
        at=event.occurred_at,
        source="event",
        kind=event.kind.value,
        text=event.message,
        fault_class=event.fault_class.value if event.fault_class else None,
        xid=event.xid,
        nodes=(event.node,) if event.node else (),
        ranks=(event.rank,) if event.rank is not None else (),
        reporter=event.source,
    )


def _action_entry(action: Action) -> Entry:
    text = action.reason + (f" (error: {action.error})" if action.error else "")
    return Entry(
        at=action.created_at,
        source="action",
        kind=action.kind.value,
        text=text,
        status=action.status.value,
        nodes=(action.node,) if action.node else (),
    )


def group(entries: Iterable[Entry], window_s: float = GROUP_S) -> list[Entry]:
    """Consecutive reports of one thing as one entry with their count (entries in time order)."""
    window = timedelta(seconds=window_s)
    grouped: list[Entry] = []
    for entry in entries:
        if grouped and grouped[-1].absorbs(entry, window):
            grouped[-1] = grouped[-1].merged(entry)
        else:
            grouped.append(entry)
    return grouped


def _rows(session: Session, model: type[Event] | type[Action], run_id: str, after: int | None,
          limit: int) -> Sequence[Any]:  # fmt: skip
    """Up to ``limit`` + 1 of the run's rows (one more tells that some were left out): the
    newest, or, after id ``after``, the oldest after it (a follower misses none)."""
    query = select(model).where(model.run_id == run_id)
    if after is None:
        query = query.order_by(model.id.desc())
    else:
        query = query.where(model.id > after).order_by(model.id)
    return session.scalars(query.limit(limit + 1)).all()


def read_timeline(session: Session, run_id: str, *, limit: int, after: Cursor | None) -> Timeline:
    """The run's newest ``limit`` events and ``limit`` actions, or the first ``limit`` of each
    recorded after ``after``, in time order."""
    events = _rows(session, Event, run_id, None if after is None else after.event_id, limit)
    actions = _rows(session, Action, run_id, None if after is None else after.action_id, limit)
    # Newest first or oldest first, the first ``limit`` are the ones to tell.
    truncated = len(events) > limit or len(actions) > limit
    events, actions = events[:limit], actions[:limit]
    start = after or Cursor()
    cursor = Cursor(
        max((e.id for e in events), default=start.event_id),
        max((a.id for a in actions), default=start.action_id),
    )
    # Ties in time keep what happened before what was done about it.
    told = [(_event_entry(e), 0, e.id) for e in events]
    done = [(_action_entry(a), 1, a.id) for a in actions]
    entries = sorted([*told, *done], key=lambda item: (item[0].at, item[1], item[2]))
    return Timeline(tuple(group(entry for entry, _, _ in entries)), cursor, truncated)
