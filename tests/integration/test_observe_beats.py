"""Which heartbeats the hang detector is given, from a real store: only those since the ranks
were last placed (restarted, or about to be after a peer failed)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import select

from slurmft.controller.detect import find_hangs
from slurmft.controller.observe import _beats, _placed_since
from slurmft.db import Database
from slurmft.db.models import Attempt, EventKind, RankHeartbeat, utcnow
from slurmft.db.records import record_event


def test_a_rank_that_exited_after_a_collective_error_is_not_frozen(
    database: Database, seed_run: Callable[..., None]
) -> None:
    """The ranks of a failed all-reduce exit one by one: rank 0 stopped beating 7 s ago, rank 2
    a second before its own error 3 s ago. Neither is frozen: the world is restarting."""
    seed_run(database, "r1", job_id="7")
    now = utcnow()
    with database.session() as s:
        attempt = s.scalars(select(Attempt)).one()
        attempt.submitted_at = now - timedelta(minutes=5)
        for rank, ago in ((0, 7.0), (2, 3.0)):
            s.add(
                RankHeartbeat(
                    run_id="r1",
                    rank=rank,
                    attempt_id=attempt.id,
                    node=f"n{rank + 1}",
                    phase="step",
                    step=12,
                    progress_age_s=5.0,
                    deadline_s=300.0,
                    seq=1,
                    sent_at=now - timedelta(seconds=ago),
                    received_at=now - timedelta(seconds=ago),
                )
            )
        before = _beats(s, "r1", attempt, _placed_since(s, "r1", attempt.submitted_at))
        findings, _ = find_hangs(before, now=now, silent_after_s=5.0)
        assert [f.rank for f in findings] == [0]  # what was wrongly found before
        error = record_event(
            s, EventKind.COLLECTIVE_ERROR, "collective_error", run_id="r1", rank=0, source="agent"
        )
        error.occurred_at = now - timedelta(seconds=6.5)
        beats = _beats(s, "r1", attempt, _placed_since(s, "r1", attempt.submitted_at))
        assert [b.rank for b in beats] == [2]
        assert find_hangs(beats, now=now, silent_after_s=5.0) == ([], None)
