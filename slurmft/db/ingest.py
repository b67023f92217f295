"""Writing agent reports into the store in batches.

The shapes here are what the daemon's ingest endpoint hands over: one batch of heartbeats and
step times per agent report. Both writes are idempotent, because agents resend a batch until it is
acknowledged: the latest-heartbeat upsert only moves forward in ``seq``, and step times are unique
per (run, rank, step) through the caller's sequence numbers (the daemon drops a batch it has seen).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Insert, bindparam, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from slurmft.db.models import RankHeartbeat, RankHeartbeatSample, StepTime, utcnow

_HEARTBEAT_UPDATED = (
    "attempt_id",
    "node",
    "phase",
    "step",
    "progress_age_s",
    "deadline_s",
    "seq",
    "sent_at",
    "received_at",
    "sampled_at",
)

# Built once: building a statement costs more than running it for a few rows.
_LATEST = RankHeartbeat.__table__
# The ranks' last sample times; an expanding IN, at most _RANKS_PER_READ ranks at a time (one
# group commit holds the ranks of many agents of a run, anywhere in the run's rank range).
_LAST_SAMPLED = select(_LATEST.c.rank, _LATEST.c.sampled_at).where(
    _LATEST.c.run_id == bindparam("run_id"),
    _LATEST.c.rank.in_(bindparam("ranks", expanding=True)),
)
_RANKS_PER_READ = 500
_NEW_SAMPLES = insert(RankHeartbeatSample.__table__)
_NEW_STEP_TIMES = insert(StepTime.__table__)


@dataclass(frozen=True, slots=True)
class HeartbeatReport:
    rank: int
    node: str
    phase: str
    step: int
    seq: int
    sent_at: datetime
    progress_age_s: float = 0.0
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepTimeReport:
    rank: int
    step: int
    compute_s: float
    wait_s: float
    ended_at: datetime
    peer_group: str = ""


def _dialect_insert(dialect: str, table: Any) -> Insert:
    if dialect == "sqlite":
        return sqlite.insert(table)
    if dialect == "postgresql":
        return postgresql.insert(table)
    raise NotImplementedError(f"no upsert for dialect {dialect}")


@functools.cache
def _heartbeat_upsert(dialect: str) -> Insert:
    """Built once per dialect: building it costs more than running it for a node's few ranks."""
    table = RankHeartbeat.__table__
    stmt = _dialect_insert(dialect, table)
    excluded = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[table.c.run_id, table.c.rank],
        set_={col: excluded[col] for col in _HEARTBEAT_UPDATED},
        # Resent or reordered batches never move a rank's heartbeat backwards.
        where=excluded.seq > table.c.seq,
    )


@dataclass(frozen=True, slots=True)
class RunReports:
    """One run's share of what is stored in one transaction (one agent batch, or the batches of
    many agents committed together)."""

    run_id: str
    attempt_id: int | None
    heartbeats: Sequence[HeartbeatReport] = ()
    step_times: Sequence[StepTimeReport] = ()


def record_reports(
    session: Session,
    reports: Sequence[RunReports],
    *,
    sample_every: timedelta = timedelta(seconds=60),
    received_at: datetime | None = None,
) -> int:
    """Store the heartbeats and step times of several runs with one executemany per table.

    Returns the number of heartbeat history samples written.
    """
    received_at = received_at or utcnow()
    samples: list[dict[str, Any]] = []
    latest: list[dict[str, Any]] = []
    for run in reports:
        _heartbeat_rows(session, run, sample_every, received_at, into=(samples, latest))
    if samples:
        session.execute(_NEW_SAMPLES, samples)
    if latest:
        session.execute(_heartbeat_upsert(session.get_bind().dialect.name), latest)
    step_rows = [
        {
            "run_id": run.run_id,
            "attempt_id": run.attempt_id,
            "rank": st.rank,
            "step": st.step,
            "peer_group": st.peer_group,
            "compute_s": st.compute_s,
            "wait_s": st.wait_s,
            "ended_at": st.ended_at,
        }
        for run in reports
        for st in run.step_times
    ]
    if step_rows:
        session.execute(_NEW_STEP_TIMES, step_rows)
    return len(samples)


def _heartbeat_rows(
    session: Session,
    run: RunReports,
    sample_every: timedelta,
    received_at: datetime,
    *,
    into: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    """Append to ``into`` = (samples, latest) the run's newest heartbeat per rank, and, as a
    history sample, those of ranks last sampled at least ``sample_every`` ago."""
    samples, latest = into
    newest: dict[int, HeartbeatReport] = {}
    for hb in run.heartbeats:  # several beats of one rank: the highest seq wins
        known = newest.get(hb.rank)
        if known is None or hb.seq > known.seq:
            newest[hb.rank] = hb
    if not newest:
        return
    ranks = list(newest)
    last_sampled: dict[int, datetime | None] = {}
    for first in range(0, len(ranks), _RANKS_PER_READ):
        chunk = ranks[first : first + _RANKS_PER_READ]
        rows = session.execute(_LAST_SAMPLED, {"run_id": run.run_id, "ranks": chunk})
        last_sampled.update((rank, at) for rank, at in rows)
    for rank, hb in newest.items():
        previous = last_sampled.get(rank)
        sampled = previous is None or hb.sent_at - previous >= sample_every
        if sampled:
            samples.append(
                {
                    "run_id": run.run_id,
                    "rank": rank,
                    "node": hb.node,
                    "phase": hb.phase,
                    "step": hb.step,
                    "sent_at": hb.sent_at,
                }
            )
        latest.append(
            {
                "run_id": run.run_id,
                "rank": rank,
                "attempt_id": run.attempt_id,
                "node": hb.node,
                "phase": hb.phase,
                "step": hb.step,
                "progress_age_s": hb.progress_age_s,
                "deadline_s": hb.deadline_s,
                "seq": hb.seq,
                "sent_at": hb.sent_at,
                "received_at": received_at,
                "sampled_at": hb.sent_at if sampled else previous,
            }
        )


def record_heartbeats(
    session: Session,
    run_id: str,
    attempt_id: int | None,
    heartbeats: Sequence[HeartbeatReport],
    *,
    sample_every: timedelta = timedelta(seconds=60),
    received_at: datetime | None = None,
) -> int:
    """Keep the newest heartbeat per rank and sample at most one per rank per ``sample_every``.

    Returns the number of history samples written.
    """
    run = RunReports(run_id, attempt_id, heartbeats=heartbeats)
    return record_reports(session, [run], sample_every=sample_every, received_at=received_at)


def record_step_times(
    session: Session,
    run_id: str,
    attempt_id: int | None,
    step_times: Sequence[StepTimeReport],
) -> int:
    """Append raw step times (one executemany); returns the number of rows written."""
    record_reports(session, [RunReports(run_id, attempt_id, step_times=step_times)])
    return len(step_times)
