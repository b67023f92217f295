"""The numbers behind the run's wall-clock timeline in `slurmft report`: world size and step
rate over time, its failures with the time each cost shaded by cause, its restarts, requeues and
the controller's actions.

Times are seconds from the run's first step time (or its start). World size and step rate come
from the raw step times, binned by the database (ranks that ended a step in the bin; steps ended
per second); the lost time comes from the figures the daemon stored at failure time
(slurmft.controller.goodput_pass), laid out from the last step before the failure: detection,
queue wait, restart, then the steps done again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, extract, func, select
from sqlalchemy.orm import Session

from slurmft.core.kinds import OUTAGE_KINDS
from slurmft.db.models import Action, ActionKind, Event, EventKind, Run, StepTime

MAX_BINS = 240
CAUSES = ("detection", "queue_wait", "restart", "replay")  # in the order they happen


@dataclass(frozen=True)
class Bin:
    start_s: float
    width_s: float
    world_size: int  # ranks that ended a step in it
    step_rate: float  # steps ended per second


@dataclass(frozen=True)
class Failure:
    at_s: float
    kind: str
    node: str | None
    lost_s: float | None  # None: not measured yet
    # (cause, start_s, end_s): detection, queue_wait, restart, replay, one after the other
    spans: tuple[tuple[str, float, float], ...] = ()
    estimate: bool = False


@dataclass(frozen=True)
class Moment:
    at_s: float
    kind: str
    node: str | None = None


@dataclass(frozen=True)
class RunTimeline:
    start: str  # ISO time of 0 s
    end_s: float
    bins: list[Bin] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    restarts: list[Moment] = field(default_factory=list)
    requeues: list[Moment] = field(default_factory=list)
    actions: list[Moment] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunTimeline:
        return cls(
            start=data["start"],
            end_s=float(data["end_s"]),
            bins=[Bin(**b) for b in data["bins"]],
            failures=[
                Failure(**{**f, "spans": tuple(tuple(s) for s in f["spans"])})
                for f in data["failures"]
            ],
            restarts=[Moment(**m) for m in data["restarts"]],
            requeues=[Moment(**m) for m in data["requeues"]],
            actions=[Moment(**m) for m in data["actions"]],
        )


def _epoch(session: Session, column: Any) -> ColumnElement[Any]:
    """Unix seconds of a stored (naive UTC) timestamp, in the database."""
    if session.get_bind().dialect.name == "sqlite":
        return (func.julianday(column) - 2440587.5) * 86400.0
    return extract("epoch", column)


def _spans(event: Event, at_s: float) -> tuple[tuple[str, float, float], ...]:
    parts = {
        "detection": event.lost_detection_s,
        "queue_wait": event.lost_queue_wait_s,
        "restart": event.lost_restart_s,
        "replay": event.lost_replay_s,
    }
    if not event.time_lost_s or any(v is None for v in parts.values()):
        return ()
    start = at_s - float(parts["detection"] or 0.0)  # the last step before the failure
    spans = []
    for cause in CAUSES:
        length = float(parts[cause] or 0.0)
        spans.append((cause, start, start + length))
        start += length
    return tuple(spans)


def _bins(session: Session, run_id: str, zero: datetime, end_s: float) -> list[Bin]:
    width = max(end_s / MAX_BINS, 1.0)
    offset = _epoch(session, StepTime.ended_at) - zero.timestamp()
    index = func.floor(offset / width).label("bin")
    rows = session.execute(
        select(index, func.count(func.distinct(StepTime.rank)), func.count())
        .where(StepTime.run_id == run_id)
        .group_by(index)
        .order_by(index)
    ).all()
    bins = []
    for number, ranks, ended in rows:
        steps = ended / ranks if ranks else 0.0  # every rank ends every step
        bins.append(Bin(float(number) * width, width, int(ranks), steps / width))
    return bins


def load_timeline(session: Session, run: Run, now: datetime) -> RunTimeline:
    first_step = session.scalar(
        select(func.min(StepTime.ended_at)).where(StepTime.run_id == run.id)
    )
    zero = run.first_step_at or first_step or run.started_at or run.created_at
    end = run.last_step_at if run.state.is_terminal and run.last_step_at else run.ended_at or now
    end_s = max((end - zero).total_seconds(), 1.0)

    def seconds(at: datetime) -> float:
        return round((at - zero).total_seconds(), 3)

    outages = session.scalars(
        select(Event)
        .where(
            Event.run_id == run.id,
            Event.kind.in_(OUTAGE_KINDS),
            Event.foreign.is_not(True),
            # The other reports of one outage hold 0 (its cost is on the first).
            (Event.time_lost_s.is_(None)) | (Event.time_lost_s > 0),
        )
        .order_by(Event.occurred_at)
    ).all()
    failures = [
        Failure(
            seconds(e.occurred_at),
            e.kind.value,
            e.node,
            e.time_lost_s,
            _spans(e, seconds(e.occurred_at)),
            bool(e.time_lost_estimate),
        )
        for e in outages
    ]
    restarts = session.scalars(
        select(Event.occurred_at).where(
            Event.run_id == run.id, Event.kind == EventKind.RESTART, Event.source == "daemon"
        )
    ).all()
    actions = session.execute(
        select(Action.created_at, Action.kind, Action.node)
        .where(Action.run_id == run.id, Action.kind != ActionKind.NOTIFY)
        .order_by(Action.created_at)
    ).all()
    moments = [Moment(seconds(at), kind.value, node) for at, kind, node in actions]
    return RunTimeline(
        start=zero.isoformat(),
        end_s=round(end_s, 3),
        bins=_bins(session, run.id, zero, end_s),
        failures=failures,
        restarts=[Moment(seconds(at), "restart") for at in restarts],
        requeues=[m for m in moments if m.kind == ActionKind.REQUEUE.value],
        actions=moments,
    )
