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

# Built once: a batch is a node's few ranks, and building a statement costs more than running it.
_LATEST = RankHeartbeat.__table__
# A range, not IN (...): an expanding IN is compiled anew for every batch. An agent's ranks are
# contiguous as a rule; other ranks in the range are read and ignored.
_LAST_SAMPLED = select(_LATEST.c.rank, _LATEST.c.sampled_at).where(
    _LATEST.c.run_id == bindparam("run_id"),
    _LATEST.c.rank.between(bindparam("lowest"), bindparam("highest")),
)
_NEW_SAMPLES = insert(RankHeartbeatSample.__table__)
_NEW_STEP_TIMES = insert(StepTime.__table__)


@dataclass(frozen=True)
class HeartbeatReport:
    rank: int
    node: str
    phase: str
    step: int
    seq: int
    sent_at: datetime
    progress_age_s: float = 0.0
    deadline_s: float | None = None


@dataclass(frozen=True)
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
    if not heartbeats:
        return 0
    received_at = received_at or utcnow()
    newest: dict[int, HeartbeatReport] = {}
    for hb in heartbeats:  # a batch may hold several beats of one rank: the highest seq wins
        if hb.rank not in newest or hb.seq > newest[hb.rank].seq:
            newest[hb.rank] = hb
    # Only this batch's ranks: an agent reports its node's few ranks of a run of many.
    ranks = {"run_id": run_id, "lowest": min(newest), "highest": max(newest)}
    last_sampled = {
        rank: at for rank, at in session.execute(_LAST_SAMPLED, ranks) if rank in newest
    }
    samples = [
        hb
        for hb in newest.values()
        if last_sampled.get(hb.rank) is None or hb.sent_at - last_sampled[hb.rank] >= sample_every
    ]
    sampled_ranks = {hb.rank for hb in samples}
    if samples:
        session.execute(
            _NEW_SAMPLES,
            [
                {
                    "run_id": run_id,
                    "rank": hb.rank,
                    "node": hb.node,
                    "phase": hb.phase,
                    "step": hb.step,
                    "sent_at": hb.sent_at,
                }
                for hb in samples
            ],
        )
    rows = [
        {
            "run_id": run_id,
            "rank": hb.rank,
            "attempt_id": attempt_id,
            "node": hb.node,
            "phase": hb.phase,
            "step": hb.step,
            "progress_age_s": hb.progress_age_s,
            "deadline_s": hb.deadline_s,
            "seq": hb.seq,
            "sent_at": hb.sent_at,
            "received_at": received_at,
            "sampled_at": hb.sent_at if hb.rank in sampled_ranks else last_sampled.get(hb.rank),
        }
        for hb in newest.values()
    ]
    upsert = _heartbeat_upsert(session.get_bind().dialect.name)
    session.execute(upsert, rows)  # one cached statement, executemany
    return len(samples)


def record_step_times(
    session: Session,
    run_id: str,
    attempt_id: int | None,
    step_times: Sequence[StepTimeReport],
) -> int:
    """Append raw step times (one executemany); returns the number of rows written."""
    if not step_times:
        return 0
    session.execute(
        _NEW_STEP_TIMES,
        [
            {
                "run_id": run_id,
                "attempt_id": attempt_id,
                "rank": st.rank,
                "step": st.step,
                "peer_group": st.peer_group,
                "compute_s": st.compute_s,
                "wait_s": st.wait_s,
                "ended_at": st.ended_at,
            }
            for st in step_times
        ],
    )
    return len(step_times)
