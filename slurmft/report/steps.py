"""The numbers behind `slurmft report`: a run's own compute time per rank and step, and what
happened on top of it (ranks flagged as stragglers or hung, the controller's actions).

Own compute time (``compute_s``, without collective wait) is what shows a straggler: every rank
*waits* as long as the slowest one, but only the slow rank *computes* longer. Raw ``step_times``
give one value per rank and step; older steps, folded by retention, come from
``step_time_minutes`` (the minute's median stands for each of its steps). A long run is binned
into at most ``max_columns`` step ranges, each the mean of its steps.

Everything here is plain data (``StepPicture.to_json``); plotting is a separate, optional module.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.db.models import (
    Action,
    Event,
    EventKind,
    RankHeartbeat,
    Run,
    StepTime,
    StepTimeMinute,
)
from slurmft.db.retention import quantile
from slurmft.errors import SlurmftError

FLAG_KINDS = (EventKind.STRAGGLER, EventKind.HANG)
DEFAULT_MAX_COLUMNS = 400


class NoStepTimes(SlurmftError):
    """The run has no step times (unknown run, or a script that never imports slurmft.train)."""


@dataclass(frozen=True)
class Mark:
    """A flag on a rank (straggler, hang) or an action/restart, placed at a step."""

    kind: str
    at: str  # ISO time
    step: int | None
    column: int | None
    reason: str
    node: str | None = None
    ranks: tuple[int, ...] = ()
    status: str | None = None  # actions only


@dataclass(frozen=True)
class StepPicture:
    run_id: str
    ranks: list[int]
    columns: list[tuple[int, int]]  # (first step, last step) of each column
    compute_s: list[list[float | None]]  # ranks x columns; None: no step time there
    median_s: list[float | None]  # per column, across ranks
    band_low_s: list[float | None]  # 25th percentile across ranks
    band_high_s: list[float | None]  # 75th percentile across ranks
    slowdown: dict[int, float]  # per rank: median over columns of its time / the column median
    nodes: dict[int, str] = field(default_factory=dict)
    flags: list[Mark] = field(default_factory=list)
    actions: list[Mark] = field(default_factory=list)

    @property
    def flagged_ranks(self) -> list[int]:
        return sorted({rank for mark in self.flags for rank in mark.ranks})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["slowdown"] = {str(k): round(v, 4) for k, v in self.slowdown.items()}
        data["nodes"] = {str(k): v for k, v in self.nodes.items()}
        data["flagged_ranks"] = self.flagged_ranks
        return data


@dataclass(frozen=True)
class _Span:
    """A run of steps with one compute value: one raw step, or a folded minute."""

    rank: int
    first: int
    last: int
    compute_s: float


def load_step_picture(
    session: Session, run_id: str, *, max_columns: int = DEFAULT_MAX_COLUMNS
) -> StepPicture:
    if session.get(Run, run_id) is None:
        raise NoStepTimes(f"no run {run_id!r} in the store (see `slurmft runs`)")
    spans, times = _spans_and_step_times(session, run_id)
    if not spans:
        raise NoStepTimes(
            f"run {run_id} has no step times: its script does not use slurmft.train's step "
            f"timer, or nothing has been reported yet"
        )
    ranks = sorted({s.rank for s in spans})
    columns = _columns(min(s.first for s in spans), max(s.last for s in spans), max_columns)
    matrix = _bin(spans, ranks, columns)
    median, low, high = _across_ranks(matrix, len(columns))
    nodes = dict(
        session.execute(
            select(RankHeartbeat.rank, RankHeartbeat.node).where(RankHeartbeat.run_id == run_id)
        ).all()
    )
    placer = _StepPlacer(times, columns)
    return StepPicture(
        run_id=run_id,
        ranks=ranks,
        columns=columns,
        compute_s=matrix,
        median_s=median,
        band_low_s=low,
        band_high_s=high,
        slowdown=_slowdown(matrix, median, ranks),
        nodes=nodes,
        flags=_flags(session, run_id, placer, nodes),
        actions=_actions(session, run_id, placer, nodes),
    )


def _spans_and_step_times(
    session: Session, run_id: str
) -> tuple[list[_Span], list[tuple[datetime, int]]]:
    """Spans of compute time, and (time, step) pairs that place marks on the step axis."""
    latest: dict[tuple[int, int], float] = {}
    step_ended: dict[int, datetime] = {}
    # A step re-run after a restart appears twice: the later time is the one that counts.
    rows = session.execute(
        select(StepTime.rank, StepTime.step, StepTime.compute_s, StepTime.ended_at)
        .where(StepTime.run_id == run_id)
        .order_by(StepTime.ended_at)
    )
    for rank, step, compute_s, ended_at in rows:
        latest[(rank, step)] = compute_s
        step_ended.setdefault(step, ended_at)
    spans = [_Span(rank, step, step, value) for (rank, step), value in latest.items()]
    minutes = session.execute(
        select(
            StepTimeMinute.rank,
            StepTimeMinute.first_step,
            StepTimeMinute.last_step,
            StepTimeMinute.compute_median_s,
            StepTimeMinute.minute,
        ).where(StepTimeMinute.run_id == run_id)
    )
    for rank, first, last, median_s, minute in minutes:
        spans.append(_Span(rank, first, last, median_s))
        step_ended.setdefault(first, minute)
    times = sorted((at, step) for step, at in step_ended.items())
    return spans, times


def _columns(first: int, last: int, max_columns: int) -> list[tuple[int, int]]:
    width = max(1, -(-(last - first + 1) // max_columns))  # ceil
    return [(s, min(s + width - 1, last)) for s in range(first, last + 1, width)]


def _bin(
    spans: list[_Span], ranks: list[int], columns: list[tuple[int, int]]
) -> list[list[float | None]]:
    """Mean compute time per rank and column, each span weighted by the steps it covers there."""
    first, width = columns[0][0], columns[0][1] - columns[0][0] + 1
    row_of = {rank: i for i, rank in enumerate(ranks)}
    weighted: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for span in spans:
        for col in range((span.first - first) // width, (span.last - first) // width + 1):
            lo, hi = columns[col]
            steps = min(hi, span.last) - max(lo, span.first) + 1
            cell = weighted[(row_of[span.rank], col)]
            cell[0] += span.compute_s * steps
            cell[1] += steps
    matrix: list[list[float | None]] = [[None] * len(columns) for _ in ranks]
    for (row, col), (total, steps) in weighted.items():
        matrix[row][col] = total / steps
    return matrix


def _across_ranks(
    matrix: list[list[float | None]], width: int
) -> tuple[list[float | None], list[float | None], list[float | None]]:
    median: list[float | None] = []
    low: list[float | None] = []
    high: list[float | None] = []
    for col in range(width):
        values = sorted(v for row in matrix if (v := row[col]) is not None)
        median.append(quantile(values, 0.5) if values else None)
        low.append(quantile(values, 0.25) if values else None)
        high.append(quantile(values, 0.75) if values else None)
    return median, low, high


def _slowdown(
    matrix: list[list[float | None]], median: list[float | None], ranks: list[int]
) -> dict[int, float]:
    result = {}
    for rank, row in zip(ranks, matrix, strict=True):
        ratios = [v / m for v, m in zip(row, median, strict=True) if v is not None and m]
        if ratios:
            result[rank] = statistics.median(ratios)
    return result


class _StepPlacer:
    """Puts a moment on the step axis: the last step that had ended by then."""

    def __init__(self, times: list[tuple[datetime, int]], columns: list[tuple[int, int]]) -> None:
        self._at = [t for t, _ in times]
        self._steps = [s for _, s in times]
        self._column_starts = [lo for lo, _ in columns]

    def place(self, moment: datetime) -> tuple[int | None, int | None]:
        i = bisect.bisect_right(self._at, moment) - 1
        if i < 0:
            return None, None  # before the first step: left of the picture
        step = self._steps[i]
        return step, bisect.bisect_right(self._column_starts, step) - 1


def _ranks_on(node: str | None, nodes: dict[int, str]) -> tuple[int, ...]:
    return tuple(sorted(rank for rank, n in nodes.items() if node is not None and n == node))


def _flags(session: Session, run_id: str, placer: _StepPlacer, nodes: dict[int, str]) -> list[Mark]:
    marks = []
    rows = session.scalars(
        select(Event)
        .where(Event.run_id == run_id, Event.kind.in_(FLAG_KINDS))
        .order_by(Event.occurred_at)
    )
    for event in rows:
        step, column = placer.place(event.occurred_at)
        ranks = (event.rank,) if event.rank is not None else _ranks_on(event.node, nodes)
        marks.append(
            Mark(
                event.kind.value,
                event.occurred_at.isoformat(),
                step,
                column,
                event.message,
                node=event.node,
                ranks=ranks,
            )
        )
    return marks


def _actions(
    session: Session, run_id: str, placer: _StepPlacer, nodes: dict[int, str]
) -> list[Mark]:
    marks = []
    for action in session.scalars(
        select(Action).where(Action.run_id == run_id).order_by(Action.created_at)
    ):
        step, column = placer.place(action.created_at)
        marks.append(
            Mark(
                action.kind.value,
                action.created_at.isoformat(),
                step,
                column,
                action.reason,
                node=action.node,
                ranks=_ranks_on(action.node, nodes),
                status=action.status.value,
            )
        )
    restarts = session.scalars(
        select(Event).where(Event.run_id == run_id, Event.kind == EventKind.RESTART)
    )
    for event in restarts:
        step, column = placer.place(event.occurred_at)
        marks.append(
            Mark("restart", event.occurred_at.isoformat(), step, column, event.message, event.node)
        )
    return sorted(marks, key=lambda m: m.at)
