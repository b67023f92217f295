"""The daemon's held straggler window gives exactly what reading the whole window gives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select

from slurmft.controller.detect import RankCompute
from slurmft.controller.observe import _step_samples, rank_compute
from slurmft.controller.step_window import StepWindows
from slurmft.db import Database
from slurmft.db.ingest import HeartbeatReport, StepTimeReport, record_heartbeats, record_step_times
from slurmft.db.models import Attempt, Run, StepTime
from slurmft.db.states import RunState

T0 = datetime(2026, 3, 1, 12, 0, 0, 250_000, tzinfo=UTC)  # not on a minute: buckets straddle
BUCKET = timedelta(minutes=1)
BUCKETS = 5
RANKS = 6


def _run(database: Database, run_id: str) -> int:
    with database.session() as s:
        s.add(Run(id=run_id, name=run_id, owner_uid=0, owner_name="root", nodes=3, command=["x"]))
        s.flush()
        s.get(Run, run_id).state = RunState.RUNNING  # type: ignore[union-attr]
        s.add(Attempt(run_id=run_id, number=1, slurm_job_id="1", submitted_at=T0))
        s.flush()
        return s.scalar(select(Attempt.id).where(Attempt.run_id == run_id))  # type: ignore[return-value]


def _steps(
    database: Database, run_id: str, attempt: int, ranks: range, *, first: int, last: int
) -> None:
    """Steps ``first``..``last`` of each rank, one every 7 s from T0; rank 2 is slow, and the
    compute times vary so that medians of even counts are means of two."""
    times = [
        StepTimeReport(
            rank=rank,
            step=step,
            compute_s=(1.3 if rank == 2 else 1.0) + ((rank * 31 + step * 17) % 11) / 100,
            wait_s=0.1,
            ended_at=T0 + timedelta(seconds=7 * step),
            peer_group="stage0" if rank < 3 else "stage1",
        )
        for step in range(first, last + 1)
        for rank in ranks
    ]
    with database.session() as s:
        record_step_times(s, run_id, attempt, times)


def _beats(database: Database, run_id: str, attempt: int, ranks: range) -> None:
    beats = [
        HeartbeatReport(rank=r, node=f"n{r // 2}", phase="step", step=1, seq=1, sent_at=T0)
        for r in ranks
    ]
    with database.session() as s:
        record_heartbeats(s, run_id, attempt, beats, received_at=T0)


def _both(
    database: Database,
    windows: StepWindows,
    run_id: str,
    now: datetime,
    since: datetime | None = None,
) -> tuple[tuple[RankCompute, ...], tuple[RankCompute, ...]]:
    since = max(since or now - BUCKET * BUCKETS, now - BUCKET * BUCKETS)
    with database.session() as s:
        whole = rank_compute(
            _step_samples(s, run_id, since), now=now, bucket=BUCKET, buckets=BUCKETS
        )
        held = windows.rank_compute(s, run_id, since=since, now=now, bucket=BUCKET, buckets=BUCKETS)
    return whole, held


def test_the_held_window_matches_a_whole_read_pass_after_pass(database: Database) -> None:
    attempt = _run(database, "r1")
    _beats(database, "r1", attempt, range(RANKS - 1))  # the last rank has no heartbeat row
    _steps(database, "r1", attempt, range(RANKS), first=0, last=60)
    windows = StepWindows()
    now = T0 + timedelta(seconds=430)
    whole, held = _both(database, windows, "r1", now)
    assert held == whole and len(held) == RANKS - 1
    assert {c.peer_group for c in held} == {"stage0", "stage1"}
    cold = windows.rows_read
    step = 61
    for _ in range(12):  # the window moves 5 s a pass; a step ends every 7 s
        now += timedelta(seconds=5)
        last = (now - T0).seconds // 7
        if last >= step:
            _steps(database, "r1", attempt, range(RANKS), first=step, last=last)
            step = last + 1
        whole, held = _both(database, windows, "r1", now)
        assert held == whole
    if database.engine.dialect.name == "sqlite":
        # Only the new rows were read (a step of 6 ranks every 7 s), not the window again.
        assert windows.rows_read - cold == RANKS * (step - 61)
    # A late report: a step that ended inside the window arrives now (new id, old end).
    _steps(database, "r1", attempt, range(3, 4), first=40, last=40)
    late_end = T0 + timedelta(seconds=7 * 40)
    assert late_end >= now - BUCKET * BUCKETS
    whole, held = _both(database, windows, "r1", now)
    assert held == whole
    # The ranks were placed again (a restart): only later steps count, buckets fill again.
    whole, held = _both(database, windows, "r1", now, since=now - timedelta(seconds=90))
    assert held == whole == ()


def test_retention_and_the_end_of_a_run_are_followed(database: Database) -> None:
    attempt = _run(database, "r1")
    _beats(database, "r1", attempt, range(RANKS))
    _steps(database, "r1", attempt, range(RANKS), first=0, last=60)
    windows = StepWindows()
    now = T0 + timedelta(seconds=430)
    assert _both(database, windows, "r1", now)[1] != ()
    # Raw rows of the window are folded away (retention with a tiny raw window) ...
    with database.session() as s:
        s.execute(delete(StepTime).where(StepTime.ended_at < T0 + timedelta(seconds=7 * 45)))
    windows.invalidate()  # ... and the daemon's retention pass says so
    whole, held = _both(database, windows, "r1", now)
    assert held == whole == ()  # the first bucket is empty now for every rank
    # A run that is no longer live is forgotten; a later pass reads it whole.
    windows.keep_only(set())
    before = windows.rows_read
    whole, held = _both(database, windows, "r1", now)
    assert held == whole
    assert windows.rows_read - before == RANKS * (60 - 45 + 1)


def test_a_clock_set_back_reads_the_window_again(database: Database) -> None:
    attempt = _run(database, "r1")
    _beats(database, "r1", attempt, range(RANKS))
    _steps(database, "r1", attempt, range(RANKS), first=0, last=60)
    windows = StepWindows()
    _both(database, windows, "r1", T0 + timedelta(seconds=430))
    whole, held = _both(database, windows, "r1", T0 + timedelta(seconds=380))
    assert held == whole and held != ()
