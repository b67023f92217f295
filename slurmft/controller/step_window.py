"""The straggler window's raw step times, held by the daemon between control passes.

Re-reading the whole window every pass costs seconds for a large run (16,384 ranks x 30 steps);
the window moves by one poll interval per pass, so a pass reads only the step_times rows added
since the last one (the autoincrement id says which) and forgets the rows that left the window.

The per-rank per-bucket medians are exactly those of ``observe.rank_compute`` over the rows the
uncached query would read: rows that ended at or after ``since`` and before ``now``, in buckets
aligned on ``now``, a rank left out when a bucket of it is empty, its node the one of its
heartbeat row (a rank without one is left out, as the uncached join leaves it out).

Staying correct:
- rows older than the window are dropped, and a window that reaches further back than the
  held one (a clock set back) is read again whole;
- a run no longer live is forgotten (``keep_only``); retention folding raw rows away is
  followed by ``invalidate`` (the daemon's retention pass), so a folded row is not counted;
- on SQLite one writer at a time assigns ids and commits, so an id below the highest one read
  never appears later. On PostgreSQL concurrent ingest transactions may commit out of id order:
  each read there starts again from the highest id of the read before (one poll interval back;
  an ingest transaction lasts milliseconds) and skips the ids it already holds. After a cold
  read that overlap is the whole window once more.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.controller.detect import RankCompute
from slurmft.db.models import RankHeartbeat, StepTime

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _us(moment: datetime) -> int:
    """Microseconds since the epoch: exact, as the timedelta arithmetic of rank_compute is."""
    return (moment - _EPOCH) // _MICROSECOND


@dataclass
class _RankSteps:
    """One rank's held rows, ordered by when they ended."""

    ended: list[int] = field(default_factory=list)  # microseconds since the epoch
    compute: list[float] = field(default_factory=list)
    group: list[str] = field(default_factory=list)

    def add(self, ended: int, compute: float, group: str) -> None:
        if not self.ended or ended >= self.ended[-1]:  # the usual case: the newest step
            self.ended.append(ended)
            self.compute.append(compute)
            self.group.append(group)
            return
        at = bisect.bisect_right(self.ended, ended)
        self.ended.insert(at, ended)
        self.compute.insert(at, compute)
        self.group.insert(at, group)

    def drop_before(self, floor: int) -> None:
        cut = bisect.bisect_left(self.ended, floor)
        if cut:
            del self.ended[:cut], self.compute[:cut], self.group[:cut]


@dataclass
class _RunWindow:
    floor: int  # rows that ended before this are not held
    settled: int = 0  # every row with an id up to this one is held (or was outside the window)
    recent: set[int] = field(default_factory=set)  # ids above ``settled`` already held
    last_high: int = 0  # the highest id of the last read
    ranks: dict[int, _RankSteps] = field(default_factory=dict)

    def add(self, rows: Sequence[Any], *, track: bool) -> int:
        """Hold (id, rank, peer_group, ended_at, compute_s) rows; returns the highest id."""
        high = self.last_high
        for row_id, rank, group, ended, compute in rows:
            if track:
                if row_id in self.recent:
                    continue
                self.recent.add(row_id)
            high = max(high, row_id)
            at = _us(ended)
            if at >= self.floor:
                steps = self.ranks.get(rank)
                if steps is None:
                    steps = self.ranks[rank] = _RankSteps()
                steps.add(at, compute, group)
        return high

    def advance(self, floor: int) -> None:
        if floor > self.floor:
            self.floor = floor
            for steps in self.ranks.values():
                steps.drop_before(floor)


class StepWindows:
    """The held windows of the live runs (one per run), for one daemon process."""

    def __init__(self) -> None:
        self._runs: dict[str, _RunWindow] = {}
        self._generation = 0  # bumped by invalidate
        self.rows_read = 0  # for the benchmark and the tests: what the reads cost

    def invalidate(self) -> None:
        """Forget everything: the next pass reads each window whole (after retention, which
        runs in another thread than the control pass)."""
        self._generation += 1
        self._runs.clear()

    def keep_only(self, run_ids: set[str]) -> None:
        for run_id in set(self._runs) - run_ids:
            self._runs.pop(run_id, None)

    def rank_compute(
        self,
        session: Session,
        run_id: str,
        *,
        since: datetime,
        now: datetime,
        bucket: timedelta,
        buckets: int,
    ) -> tuple[RankCompute, ...]:
        start = now - bucket * buckets
        window = self._read(session, run_id, _us(start))
        nodes = dict(
            session.execute(
                select(RankHeartbeat.rank, RankHeartbeat.node).where(RankHeartbeat.run_id == run_id)
            ).all()
        )
        first = _us(start)
        width = bucket // _MICROSECOND
        # Bucket k holds [start + k * bucket, start + (k + 1) * bucket), none before ``since``.
        bounds = [max(_us(since), first), *(first + k * width for k in range(1, buckets + 1))]
        computes = []
        for rank in sorted(window.ranks):
            node = nodes.get(rank)
            if node is None:
                continue
            steps = window.ranks[rank]
            ended, compute = steps.ended, steps.compute
            cuts = [bisect.bisect_left(ended, b) for b in bounds]
            medians = []
            for low, high in itertools.pairwise(cuts):  # plain loops: this runs for every rank
                if low >= high:
                    break  # an empty bucket: restarting or gone
                # statistics.median, inlined: this runs for every rank and bucket of every pass
                ordered = sorted(compute[low:high])
                mid = (high - low) // 2
                medians.append(
                    ordered[mid] if (high - low) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
                )
            else:
                computes.append(
                    RankCompute(rank, node, tuple(medians), peer_group=steps.group[cuts[-1] - 1])
                )
        return tuple(computes)

    def _read(self, session: Session, run_id: str, floor: int) -> _RunWindow:
        track = session.get_bind().dialect.name != "sqlite"
        generation = self._generation
        window = self._runs.get(run_id)
        columns = (StepTime.id, StepTime.rank, StepTime.peer_group, StepTime.ended_at)
        query = select(*columns, StepTime.compute_s).where(StepTime.run_id == run_id)
        if window is None or floor < window.floor:
            window = self._runs[run_id] = _RunWindow(floor=floor)
            since = _EPOCH + floor * _MICROSECOND
            rows = session.execute(query.where(StepTime.ended_at >= since)).all()
            high = window.add(rows, track=track)
            # Cold: on PostgreSQL the next read takes the whole window again (see above).
            window.settled = min((r[0] for r in rows), default=high + 1) - 1 if track else high
        else:
            window.advance(floor)
            # By id range only: with `run_id = ?` SQLite picks the run_id index and walks every
            # row of the run; `run_id || ''` is the same test and uses no index.
            newer = select(*columns, StepTime.compute_s).where(
                StepTime.id > window.settled, StepTime.run_id.concat("") == run_id
            )
            rows = session.execute(newer).all()
            high = window.add(rows, track=track)
            window.settled = window.last_high if track else high
            if track:
                window.recent = {i for i in window.recent if i > window.settled}
        window.last_high = high
        self.rows_read += len(rows)
        if generation != self._generation:  # invalidated while reading: do not keep it
            self._runs.pop(run_id, None)
        return window
