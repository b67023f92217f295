from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from slurmft.db import Database, DatabaseUnavailable
from slurmft.db.database import DatabaseBusy
from slurmft.db.history import read_view
from slurmft.db.ingest import (
    HeartbeatReport,
    StepTimeReport,
    record_heartbeats,
    record_step_times,
)
from slurmft.db.models import (
    Attempt,
    DenylistEntry,
    Event,
    EventKind,
    FaultClass,
    RankHeartbeat,
    RankHeartbeatSample,
    Run,
    StepTime,
    StepTimeMinute,
)
from slurmft.db.retention import (
    fold_minute,
    fold_step_times,
    minutes_to_fold,
    prune_heartbeat_samples,
)
from slurmft.db.states import AttemptState, IllegalTransition, RunState

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _run(run_id: str, state: RunState = RunState.RUNNING, **kw: object) -> Run:
    run = Run(
        id=run_id,
        name=f"name-{run_id}",
        owner_uid=1000,
        owner_name="alice",
        nodes=2,
        spares=1,
        command=["python", "train.py"],
    )
    if state is not RunState.PENDING:
        run.state = RunState.RUNNING
    if state not in {RunState.PENDING, RunState.RUNNING}:
        run.state = state
    for key, value in kw.items():
        setattr(run, key, value)
    return run


def _event(
    run_id: str,
    kind: EventKind,
    node: str | None,
    fault: FaultClass | None,
    lost: float | None = None,
    *,
    xid: int | None = None,
    minutes: int = 0,
) -> Event:
    return Event(
        run_id=run_id,
        kind=kind,
        node=node,
        fault_class=fault,
        time_lost_s=lost,
        xid=xid,
        occurred_at=T0 + timedelta(minutes=minutes),
    )


def _seed_failures(database: Database) -> None:
    with database.session() as s:
        s.add_all(
            [
                _run("rA", RunState.COMPLETED, started_at=T0, ended_at=T0 + timedelta(hours=10)),
                _run(
                    "rB",
                    RunState.STOPPED,
                    started_at=T0 + timedelta(days=1),
                    ended_at=T0 + timedelta(days=1, hours=2),
                ),
                _run("rC", RunState.PENDING),
            ]
        )
        s.flush()
        s.add_all(
            [
                Attempt(run_id="rA", number=1),
                Attempt(run_id="rA", number=2),
                Attempt(run_id="rB", number=1),
            ]
        )
        s.add_all(
            [
                _event("rA", EventKind.NODE_LOST, "n1", FaultClass.HARDWARE, 600, minutes=1),
                _event(
                    "rA", EventKind.GPU_FAULT, "n1", FaultClass.HARDWARE, 1200, xid=79, minutes=2
                ),
                _event("rA", EventKind.HANG, "n2", FaultClass.HANG, 300, minutes=3),
                _event("rA", EventKind.RESTART, None, FaultClass.HARDWARE),
                _event("rA", EventKind.RESTART, None, FaultClass.HARDWARE),
                _event("rA", EventKind.RESTART, None, FaultClass.HANG),
                _event("rA", EventKind.CHECKPOINT, "n1", None),  # progress, not a failure
                _event(
                    "rB", EventKind.GPU_FAULT, "n1", FaultClass.HARDWARE, 1800, xid=48, minutes=4
                ),
                _event("rB", EventKind.RANK_FAILURE, "n3", FaultClass.USER_CODE, 0, minutes=5),
                _event("rB", EventKind.RESTART, None, FaultClass.USER_CODE),
                _event("rB", EventKind.RESTART, None, FaultClass.TIME_LIMIT),
            ]
        )
        s.add_all(
            [
                DenylistEntry(node="n1", reason="slurmft: Xid 79"),
                DenylistEntry(node="n2", run_id="rA", reason="hang in rA only"),
            ]
        )


def _view(database: Database, name: str, run_id: str | None = None) -> list[dict[str, object]]:
    with database.session() as s:
        return read_view(s, name, run_id=run_id)


def test_failures_by_node(database: Database) -> None:
    _seed_failures(database)
    rows = {(r["node"], r["kind"], r["xid"]): r for r in _view(database, "failures_by_node")}
    assert set(rows) == {
        ("n1", "node_lost", None),
        ("n1", "gpu_fault", 79),
        ("n1", "gpu_fault", 48),
        ("n2", "hang", None),
        ("n3", "rank_failure", None),
    }
    assert rows[("n1", "gpu_fault", 79)]["fault_class"] == "hardware"
    assert all(r["failures"] == 1 and r["runs"] == 1 for r in rows.values())
    assert str(rows[("n3", "rank_failure", None)]["first_at"]).startswith("2026-11-01")


def test_failures_by_class(database: Database) -> None:
    _seed_failures(database)
    rows = {
        (r["fault_class"], r["kind"], r["xid"]): r for r in _view(database, "failures_by_class")
    }
    assert rows[("hardware", "gpu_fault", 48)]["time_lost_s"] == pytest.approx(1800)
    assert rows[("hardware", "node_lost", None)]["time_lost_s"] == pytest.approx(600)
    assert rows[("hang", "hang", None)]["nodes"] == 1
    assert sum(r["failures"] for r in rows.values()) == 5


def test_run_failures_and_time_lost(database: Database) -> None:
    _seed_failures(database)
    rows = {r["run_id"]: r for r in _view(database, "run_failures")}
    assert {k: (v["failures"], float(v["time_lost_s"])) for k, v in rows.items()} == {
        "rA": (3, 2100.0),
        "rB": (2, 1800.0),
        "rC": (0, 0.0),
    }
    assert [r["run_id"] for r in _view(database, "run_failures", run_id="rB")] == ["rB"]


def test_run_restarts_per_class(database: Database) -> None:
    _seed_failures(database)
    rows = {r["run_id"]: r for r in _view(database, "run_restarts")}
    keys = (
        "restarts",
        "hardware",
        "hang",
        "straggler",
        "user_code",
        "preemption",
        "other",
        "attempts",
    )
    assert {k: tuple(v[c] for c in keys) for k, v in rows.items()} == {
        "rA": (3, 2, 1, 0, 0, 0, 0, 2),
        "rB": (2, 0, 0, 0, 1, 1, 0, 1),
        "rC": (0, 0, 0, 0, 0, 0, 0, 0),
    }


def test_node_lemons_ranked(database: Database) -> None:
    _seed_failures(database)
    rows = _view(database, "node_lemons")
    assert [
        (
            r["node"],
            r["position"],
            r["failures"],
            r["hardware_failures"],
            r["runs"],
            r["denylisted"],
        )
        for r in rows
    ] == [("n1", 1, 3, 3, 2, 1), ("n2", 2, 1, 0, 1, 0), ("n3", 2, 1, 0, 1, 0)]


def test_run_effective_time(database: Database) -> None:
    _seed_failures(database)
    rows = {r["run_id"]: r for r in _view(database, "run_effective_time")}
    assert set(rows) == {"rA", "rB"}  # rC never started
    assert float(rows["rA"]["wall_s"]) == pytest.approx(36000, abs=0.01)
    assert float(rows["rA"]["lost_s"]) == pytest.approx(2100)
    assert float(rows["rA"]["effective_ratio"]) == pytest.approx(33900 / 36000)
    assert float(rows["rB"]["effective_ratio"]) == pytest.approx(0.75)


def test_running_run_measures_up_to_now(database: Database) -> None:
    with database.session() as s:
        s.add(_run("rN", started_at=datetime.now(UTC) - timedelta(hours=1)))
    (row,) = _view(database, "run_effective_time")
    assert float(row["wall_s"]) == pytest.approx(3600, abs=30)
    assert float(row["effective_ratio"]) == pytest.approx(1.0)


def test_states_persist_and_illegal_transitions_raise(database: Database) -> None:
    with database.session() as s:
        run = _run("rS")
        s.add(run)
        s.flush()
        s.add(Attempt(run_id="rS", number=1, slurm_job_id="42"))
    with database.session() as s:
        run = s.get(Run, "rS")
        assert run is not None and run.state is RunState.RUNNING
        attempt = run.attempts[0]
        assert attempt.state is AttemptState.SUBMITTED
        with pytest.raises(IllegalTransition):
            attempt.state = AttemptState.REQUEUED  # never ran
        run.state = RunState.STOPPED
        run.end_reason = "5 restarts without progress"
    with database.session() as s:
        run = s.get(Run, "rS")
        assert run is not None and run.state is RunState.STOPPED
        with pytest.raises(IllegalTransition):
            run.state = RunState.RUNNING


def test_timestamps_come_back_as_utc(database: Database) -> None:
    moment = datetime(2026, 11, 29, 12, 30, 1, 123456, tzinfo=UTC)
    with database.session() as s:
        s.add(_run("rT", started_at=moment.astimezone(datetime.now().astimezone().tzinfo)))
    with database.session() as s:
        run = s.get(Run, "rT")
        assert run is not None and run.started_at == moment
        assert run.started_at.tzinfo is UTC
        run.ended_at = datetime(2026, 11, 29)  # naive: refused at flush
        with pytest.raises(Exception, match="naive datetime"):
            s.flush()
        s.rollback()


def _beats(seq: int, at: datetime, ranks: int = 4) -> list[HeartbeatReport]:
    return [
        HeartbeatReport(
            rank=r, node=f"n{r // 2 + 1}", phase="step", step=seq * 10, seq=seq, sent_at=at
        )
        for r in range(ranks)
    ]


def test_heartbeats_keep_the_newest_and_sample_history(database: Database) -> None:
    with database.session() as s:
        s.add(_run("rH"))
    every = timedelta(seconds=60)
    with database.session() as s:
        assert record_heartbeats(s, "rH", None, _beats(1, T0), sample_every=every) == 4
    with database.session() as s:
        assert (
            record_heartbeats(
                s, "rH", None, _beats(2, T0 + timedelta(seconds=10)), sample_every=every
            )
            == 0
        )
    with database.session() as s:  # a resent old batch changes nothing
        assert record_heartbeats(s, "rH", None, _beats(1, T0), sample_every=every) == 0
    with database.session() as s:
        assert (
            record_heartbeats(
                s, "rH", None, _beats(3, T0 + timedelta(seconds=70)), sample_every=every
            )
            == 4
        )
    with database.session() as s:
        latest = s.scalars(select(RankHeartbeat).order_by(RankHeartbeat.rank)).all()
        assert [(h.rank, h.seq, h.step) for h in latest] == [(r, 3, 30) for r in range(4)]
        assert s.scalar(select(func.count()).select_from(RankHeartbeatSample)) == 8
    with database.session() as s:
        assert prune_heartbeat_samples(s, T0 + timedelta(seconds=30)) == 4
        assert s.scalar(select(func.count()).select_from(RankHeartbeatSample)) == 4


def test_heartbeats_within_one_batch_take_the_highest_seq(database: Database) -> None:
    with database.session() as s:
        s.add(_run("rH2"))
    beats = [
        HeartbeatReport(0, "n1", "step", 5, 5, T0),
        HeartbeatReport(
            0,
            "n1",
            "checkpoint",
            6,
            6,
            T0 + timedelta(seconds=1),
            progress_age_s=540.0,
            deadline_s=1800.0,
        ),
        HeartbeatReport(0, "n1", "step", 4, 4, T0),
    ]
    with database.session() as s:
        record_heartbeats(s, "rH2", None, beats)
    with database.session() as s:
        hb = s.get(RankHeartbeat, ("rH2", 0))
        assert hb is not None and (hb.seq, hb.phase) == (6, "checkpoint")
        assert (hb.progress_age_s, hb.deadline_s) == (540.0, 1800.0)


def test_step_times_fold_into_minutes(database: Database) -> None:
    with database.session() as s:
        s.add(_run("rF"))
    reports = []
    for minute in range(3):
        for i in range(20):  # rank 0: compute 1.00..1.19 s; rank 1: twice as slow
            at = T0 + timedelta(minutes=minute, seconds=i * 3)
            step = minute * 20 + i
            reports.append(StepTimeReport(0, step, 1.0 + i / 100, 0.5, at))
            reports.append(StepTimeReport(1, step, 2.0 + i / 50, 0.1, at, peer_group="stage1"))
    with database.session() as s:
        assert record_step_times(s, "rF", None, reports) == 120
    with database.session() as s:
        # Cut-off mid-minute 2: minutes 0 and 1 fold whole, minute 2 stays raw.
        assert fold_step_times(s, T0 + timedelta(minutes=2, seconds=30)) == 80
    with database.session() as s:
        minutes = s.scalars(
            select(StepTimeMinute).order_by(StepTimeMinute.minute, StepTimeMinute.rank)
        ).all()
        assert [(m.rank, m.minute, m.steps) for m in minutes] == [
            (0, T0, 20),
            (1, T0, 20),
            (0, T0 + timedelta(minutes=1), 20),
            (1, T0 + timedelta(minutes=1), 20),
        ]
        rank0 = minutes[0]
        assert rank0.compute_median_s == pytest.approx(1.095)
        assert rank0.compute_p95_s == pytest.approx(1.0 + 0.1805)
        assert rank0.compute_total_s == pytest.approx(sum(1.0 + i / 100 for i in range(20)))
        assert rank0.wait_median_s == pytest.approx(0.5)
        assert (rank0.first_step, rank0.last_step) == (0, 19)
        assert minutes[1].peer_group == "stage1"
        assert minutes[1].compute_median_s == pytest.approx(2.19)
        assert s.scalar(select(func.count()).select_from(StepTime)) == 40
    with database.session() as s:  # a late row for a folded minute merges into it
        record_step_times(
            s, "rF", None, [StepTimeReport(0, 999, 1.5, 0.5, T0 + timedelta(seconds=59))]
        )
    with database.session() as s:
        assert fold_step_times(s, T0 + timedelta(minutes=2, seconds=30)) == 1
    with database.session() as s:
        merged = s.get(StepTimeMinute, ("rF", 0, T0))
        assert merged is not None and merged.steps == 21 and merged.last_step == 999
        assert merged.compute_total_s == pytest.approx(sum(1.0 + i / 100 for i in range(20)) + 1.5)


def test_a_retention_pass_folds_one_minute_per_transaction(database: Database) -> None:
    """The daemon folds (run, minute) by (run, minute), each in its own transaction, so a
    large run's fold never holds SQLite's writer lock for long."""
    with database.session() as s:
        s.add(_run("rM"))
    reports = [StepTimeReport(rank, minute * 10 + i, 1.0, 0.1, T0 + timedelta(minutes=minute,
                                                                           seconds=i * 5))
               for minute in range(3) for i in range(10) for rank in range(4)]  # fmt: skip
    with database.session() as s:
        record_step_times(s, "rM", None, reports)
    cutoff = T0 + timedelta(minutes=2, seconds=30)
    # The daemon's way: the minutes to fold read once (minute 2 is not before the cutoff) ...
    with database.session() as s:
        todo = minutes_to_fold(s, cutoff, max_minutes=60)
    assert todo == [("rM", T0), ("rM", T0 + timedelta(minutes=1))]
    # ... then each minute folded in a transaction of its own.
    folded = []
    for run_id, minute in todo:
        with database.session() as s:
            folded.append(fold_minute(s, run_id, minute))
    assert folded == [40, 40]
    with database.session() as s:
        assert fold_step_times(s, cutoff, max_minutes=1) == 0  # nothing left before the cutoff
    with database.session() as s:
        assert s.scalar(select(func.count()).select_from(StepTimeMinute)) == 8
        assert s.scalar(select(func.count()).select_from(StepTime)) == 40


def test_a_writer_held_past_the_busy_timeout_is_a_busy_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'slurmft.db'}"
    holder, waiter = Database(url), Database(url, busy_timeout_ms=100)
    holder.upgrade()
    with holder.engine.connect() as held:
        held.exec_driver_sql("BEGIN IMMEDIATE")  # another writer, mid-transaction
        busy = pytest.raises(DatabaseBusy, match=r"busy: another writer held it past")
        with busy, waiter.session() as s:
            s.add(_run("rB"))
        held.exec_driver_sql("ROLLBACK")
    with waiter.session() as s:  # once it is let go, the write goes through
        s.add(_run("rB"))
    holder.dispose()
    waiter.dispose()


def test_unreachable_postgres_is_a_clear_error() -> None:
    database = Database("postgresql://nobody@127.0.0.1:1/nothing")
    with pytest.raises(DatabaseUnavailable, match=r"cannot reach the store at .*127\.0\.0\.1:1"):
        database.current_revision()


def test_unwritable_sqlite_location_is_a_clear_error() -> None:
    with pytest.raises(DatabaseUnavailable, match=r"paths\.state_dir"):
        Database("sqlite:////proc/slurmft-nope/slurmft.db")
