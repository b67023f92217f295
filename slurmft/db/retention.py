"""Bounded raw data: fold old step times into per-rank per-minute aggregates, prune old samples.

Raw step times are kept for ``retention.step_times_raw_hours``; then each (run, rank, minute) is
folded into one ``step_time_minutes`` row (median, p95 and totals of compute and wait) and the raw
rows are deleted in the same transaction, so nothing is lost between the two. The cut-off is
floored to a whole minute so a minute is folded once, whole. A raw row that arrives late for a
minute already folded is merged into it: counts and totals stay exact, the median and p95 of such
a merged minute are approximate (weighted mean and max).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, select
from sqlalchemy.orm import Session

from slurmft.db.models import RankHeartbeatSample, StepTime, StepTimeMinute


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted, non-empty list."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    position = (len(sorted_values) - 1) * q
    low = math.floor(position)
    high = math.ceil(position)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def floor_minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


@dataclass
class _MinuteStats:
    peer_group: str
    steps: list[int]
    compute: list[float]
    wait: list[float]

    def as_row(self, run_id: str, rank: int, minute: datetime) -> StepTimeMinute:
        compute = sorted(self.compute)
        wait = sorted(self.wait)
        return StepTimeMinute(
            run_id=run_id,
            rank=rank,
            minute=minute,
            peer_group=self.peer_group,
            steps=len(self.steps),
            first_step=min(self.steps),
            last_step=max(self.steps),
            compute_median_s=quantile(compute, 0.5),
            compute_p95_s=quantile(compute, 0.95),
            compute_total_s=sum(compute),
            wait_median_s=quantile(wait, 0.5),
            wait_p95_s=quantile(wait, 0.95),
            wait_total_s=sum(wait),
        )


def _merge(existing: StepTimeMinute, new: StepTimeMinute) -> None:
    total = existing.steps + new.steps
    for field in ("compute_median_s", "wait_median_s"):
        weighted = getattr(existing, field) * existing.steps + getattr(new, field) * new.steps
        setattr(existing, field, weighted / total)
    existing.compute_p95_s = max(existing.compute_p95_s, new.compute_p95_s)
    existing.wait_p95_s = max(existing.wait_p95_s, new.wait_p95_s)
    existing.compute_total_s += new.compute_total_s
    existing.wait_total_s += new.wait_total_s
    existing.first_step = min(existing.first_step, new.first_step)
    existing.last_step = max(existing.last_step, new.last_step)
    existing.steps = total


def _fold_minute(session: Session, run_id: str, minute: datetime) -> int:
    rows = session.execute(
        select(
            StepTime.rank, StepTime.step, StepTime.peer_group, StepTime.compute_s, StepTime.wait_s
        ).where(
            StepTime.run_id == run_id,
            StepTime.ended_at >= minute,
            StepTime.ended_at < minute + timedelta(minutes=1),
        )
    ).all()
    if not rows:
        return 0
    per_rank: dict[int, _MinuteStats] = defaultdict(lambda: _MinuteStats("", [], [], []))
    for rank, step, peer_group, compute_s, wait_s in rows:
        stats = per_rank[rank]
        stats.peer_group = peer_group
        stats.steps.append(step)
        stats.compute.append(compute_s)
        stats.wait.append(wait_s)
    # One read of the minute's aggregates already there (late rows), not one per rank: a minute
    # of a 16,384-rank run is 16,384 of them.
    folded_before = {
        row.rank: row
        for row in session.scalars(
            select(StepTimeMinute).where(
                StepTimeMinute.run_id == run_id, StepTimeMinute.minute == minute
            )
        )
    }
    for rank, stats in per_rank.items():
        row = stats.as_row(run_id, rank, minute)
        existing = folded_before.get(rank)
        if existing is None:
            session.add(row)
        else:
            _merge(existing, row)
    session.execute(
        delete(StepTime).where(
            StepTime.run_id == run_id,
            StepTime.ended_at >= minute,
            StepTime.ended_at < minute + timedelta(minutes=1),
        )
    )
    return len(rows)


def fold_step_times(session: Session, older_than: datetime, *, max_minutes: int = 60) -> int:
    """Fold raw step times that ended before ``older_than`` into minute aggregates, in this
    session's one transaction; returns the number of raw rows folded. (The daemon folds each
    minute of `minutes_to_fold` in a transaction of its own: `fold_minute`.)"""
    todo = minutes_to_fold(session, older_than, max_minutes=max_minutes)
    return sum(fold_minute(session, run_id, minute) for run_id, minute in todo)


def minutes_to_fold(
    session: Session, older_than: datetime, *, max_minutes: int = 60
) -> list[tuple[str, datetime]]:
    """The (run, minute) groups of raw step times that ended before ``older_than``, oldest
    first per run, at most ``max_minutes``: read once, so a pass folding them one transaction at
    a time does not group the whole table again for each."""
    cutoff = floor_minute(older_than)
    found: list[tuple[str, datetime]] = []
    starts = session.execute(
        select(StepTime.run_id, func.min(StepTime.ended_at))
        .where(StepTime.ended_at < cutoff)
        .group_by(StepTime.run_id)
    ).all()
    for run_id, first in starts:
        minute = floor_minute(first)
        while minute < cutoff and len(found) < max_minutes:
            found.append((run_id, minute))
            next_minute = session.execute(
                select(func.min(StepTime.ended_at)).where(
                    StepTime.run_id == run_id, StepTime.ended_at >= minute + timedelta(minutes=1)
                )
            ).scalar_one_or_none()
            if next_minute is None:
                break
            minute = floor_minute(next_minute)
    return found


def fold_minute(session: Session, run_id: str, minute: datetime) -> int:
    """One run's raw step times of one minute into its aggregates; the raw rows folded."""
    return _fold_minute(session, run_id, minute)


def prune_heartbeat_samples(session: Session, older_than: datetime) -> int:
    """Delete sampled heartbeat history older than the window; the latest beat per rank stays."""
    # A DELETE's result is a CursorResult (it has rowcount); Session.execute is typed Result.
    result = cast(
        "CursorResult[Any]",
        session.execute(
            delete(RankHeartbeatSample).where(RankHeartbeatSample.sent_at < older_than)
        ),
    )
    return int(result.rowcount or 0)
