"""The numbers behind `slurmft report`: a run's own compute time per rank and step, and what
happened on top of it (ranks flagged as stragglers or hung, the controller's actions).

Own compute time (``compute_s``, without collective wait) is what shows a straggler: every rank
*waits* as long as the slowest one, but only the slow rank *computes* longer. Raw ``step_times``
give one value per rank and step; older steps, folded by retention, come from
``step_time_minutes`` (the minute's median stands for each of its steps). A long run is binned
into at most ``max_columns`` step ranges, each the mean of its steps, by the database. A step run
twice (re-run from a checkpoint after a restart) counts with both of its runs.

Everything here is plain data (``StepPicture.to_json``); plotting is a separate, optional module.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
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
from slurmft.report import DEFAULT_MAX_COLUMNS
from slurmft.report.timeline import RunTimeline, load_timeline

FLAG_KINDS = (EventKind.STRAGGLER, EventKind.HANG)


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
    # Per rank, its slowest window of the run: (slowdown, first step, last step). A straggler
    # that appears late is plain here; the whole-run median above would hide it.
    worst_window: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    timeline: RunTimeline | None = None

    @property
    def flagged_ranks(self) -> list[int]:
        return sorted({rank for mark in self.flags for rank in mark.ranks})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["slowdown"] = {str(k): round(v, 4) for k, v in self.slowdown.items()}
        data["worst_window"] = {str(k): list(v) for k, v in self.worst_window.items()}
        data["nodes"] = {str(k): v for k, v in self.nodes.items()}
        data["flagged_ranks"] = self.flagged_ranks
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepPicture:
        """`to_json`'s output back (the daemon sends it; the client draws it)."""

        def marks(items: list[dict[str, Any]]) -> list[Mark]:
            return [Mark(**{**m, "ranks": tuple(m.get("ranks", ()))}) for m in items]

        return cls(
            run_id=data["run_id"],
            ranks=list(data["ranks"]),
            columns=[(int(a), int(b)) for a, b in data["columns"]],
            compute_s=[list(row) for row in data["compute_s"]],
            median_s=list(data["median_s"]),
            band_low_s=list(data["band_low_s"]),
            band_high_s=list(data["band_high_s"]),
            slowdown={int(k): float(v) for k, v in data["slowdown"].items()},
            nodes={int(k): v for k, v in data["nodes"].items()},
            flags=marks(data["flags"]),
            actions=marks(data["actions"]),
            worst_window={
                int(k): (float(v[0]), int(v[1]), int(v[2]))
                for k, v in data.get("worst_window", {}).items()
            },
            timeline=RunTimeline.from_json(data["timeline"]) if data.get("timeline") else None,
        )


def load_step_picture(
    session: Session, run_id: str, *, max_columns: int = DEFAULT_MAX_COLUMNS
) -> StepPicture:
    run = session.get(Run, run_id)
    if run is None:
        raise NoStepTimes(f"no run {run_id!r} in the store (see `slurmft runs`)")
    bounds = _step_bounds(session, run_id)
    if bounds is None:
        raise NoStepTimes(
            f"run {run_id} has no step times: its script does not use slurmft.train's step "
            f"timer, or nothing has been reported yet"
        )
    columns = _columns(*bounds, max_columns)
    cells = _binned_compute(session, run_id, columns)
    ranks = sorted({rank for rank, _ in cells})
    row_of = {rank: i for i, rank in enumerate(ranks)}
    matrix: list[list[float | None]] = [[None] * len(columns) for _ in ranks]
    for (rank, col), (total, steps) in cells.items():
        matrix[row_of[rank]][col] = total / steps
    median, low, high = _across_ranks(matrix, len(columns))
    nodes = dict(
        session.execute(
            select(RankHeartbeat.rank, RankHeartbeat.node).where(RankHeartbeat.run_id == run_id)
        ).all()
    )
    placer = _StepPlacer(session, run_id, columns)
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
        worst_window=worst_windows(matrix, median, ranks, columns),
        timeline=load_timeline(session, run, datetime.now(UTC)),
    )


def _step_bounds(session: Session, run_id: str) -> tuple[int, int] | None:
    raw = session.execute(
        select(func.min(StepTime.step), func.max(StepTime.step)).where(StepTime.run_id == run_id)
    ).one()
    folded = session.execute(
        select(func.min(StepTimeMinute.first_step), func.max(StepTimeMinute.last_step)).where(
            StepTimeMinute.run_id == run_id
        )
    ).one()
    firsts = [v for v in (raw[0], folded[0]) if v is not None]
    lasts = [v for v in (raw[1], folded[1]) if v is not None]
    return (min(firsts), max(lasts)) if firsts else None


def _columns(first: int, last: int, max_columns: int) -> list[tuple[int, int]]:
    width = max(1, -(-(last - first + 1) // max_columns))  # ceil
    return [(s, min(s + width - 1, last)) for s in range(first, last + 1, width)]


def _binned_compute(
    session: Session, run_id: str, columns: list[tuple[int, int]]
) -> dict[tuple[int, int], list[float]]:
    """(rank, column) -> [compute seconds summed, steps], binned by the database: a long run
    at 16k ranks has billions of raw rows, and only ranks x columns numbers leave the store."""
    first, width = columns[0][0], columns[0][1] - columns[0][0] + 1
    cells: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    col = ((StepTime.step - first) // width).label("col")
    raw = session.execute(
        select(StepTime.rank, col, func.sum(StepTime.compute_s), func.count())
        .where(StepTime.run_id == run_id)
        .group_by(StepTime.rank, col)
    )
    for rank, column, total, steps in raw:
        cell = cells[(rank, int(column))]
        cell[0] += float(total)
        cell[1] += steps
    # A folded minute covers many steps, maybe several columns: its median stands for each step,
    # spread evenly over the columns it covers.
    first_col = ((StepTimeMinute.first_step - first) // width).label("first_col")
    last_col = ((StepTimeMinute.last_step - first) // width).label("last_col")
    folded = session.execute(
        select(
            StepTimeMinute.rank,
            first_col,
            last_col,
            func.sum(StepTimeMinute.compute_median_s * StepTimeMinute.steps),
            func.sum(StepTimeMinute.steps),
        )
        .where(StepTimeMinute.run_id == run_id)
        .group_by(StepTimeMinute.rank, first_col, last_col)
    )
    for rank, c0, c1, total, steps in folded:
        share = 1 / (int(c1) - int(c0) + 1)
        for column in range(int(c0), int(c1) + 1):
            cell = cells[(rank, column)]
            cell[0] += float(total) * share
            cell[1] += float(steps) * share
    return cells


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


WINDOWS = 8  # a run's columns are judged in this many windows for each rank's worst


def worst_windows(
    matrix: list[list[float | None]],
    median: list[float | None],
    ranks: list[int],
    columns: list[tuple[int, int]],
    windows: int = WINDOWS,
) -> dict[int, tuple[float, int, int]]:
    """Each rank's slowest window: the median, over the window's columns, of its time over
    the column's median across ranks; with the window's first and last step."""
    width = max(1, -(-len(columns) // windows))  # ceil
    worst: dict[int, tuple[float, int, int]] = {}
    for rank, row in zip(ranks, matrix, strict=True):
        for start in range(0, len(columns), width):
            cells = zip(row[start : start + width], median[start : start + width], strict=True)
            ratios = [v / m for v, m in cells if v is not None and m]
            if not ratios:
                continue
            found = statistics.median(ratios)
            if rank not in worst or found > worst[rank][0]:
                last = min(start + width, len(columns)) - 1
                worst[rank] = (found, columns[start][0], columns[last][1])
    return worst


class _StepPlacer:
    """Puts a moment on the step axis: the step of the latest step time ended by then (after a
    restart, steps go back to the checkpoint's). One or two indexed queries per mark."""

    def __init__(self, session: Session, run_id: str, columns: list[tuple[int, int]]) -> None:
        self._session = session
        self._run_id = run_id
        self._column_starts = [lo for lo, _ in columns]

    def place(self, moment: datetime) -> tuple[int | None, int | None]:
        step = self._session.scalar(
            select(StepTime.step)
            .where(StepTime.run_id == self._run_id, StepTime.ended_at <= moment)
            .order_by(StepTime.ended_at.desc())
            .limit(1)
        )
        if step is None:
            step = self._session.scalar(
                select(StepTimeMinute.last_step)
                .where(StepTimeMinute.run_id == self._run_id, StepTimeMinute.minute <= moment)
                .order_by(StepTimeMinute.minute.desc())
                .limit(1)
            )
        if step is None:
            return None, None  # before the first step: left of the picture
        return step, max(0, bisect.bisect_right(self._column_starts, step) - 1)


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
