"""Each failure's cost, measured by the daemon's goodput pass from the stored step times and
written onto the failure, then added up by the views, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from slurmft.controller.goodput_pass import measure_failures
from slurmft.db import Database
from slurmft.db.history import read_view
from slurmft.db.models import Attempt, Event, EventKind, FaultClass, Run, StepTime
from slurmft.db.states import RunState

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def _t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _steps(run_id: str, steps: range, start_s: float) -> list[StepTime]:
    return [
        StepTime(
            run_id=run_id,
            rank=rank,
            step=step,
            compute_s=0.8,
            wait_s=0.2,
            ended_at=_t(start_s + i + rank * 0.002),
        )
        for i, step in enumerate(steps)
        for rank in range(4)
    ]


def _seed(database: Database, seed_run: Callable[..., None]) -> None:
    """Steps 1-100 a second apart; n2 lost (a peer saw it at 103 s, the daemon's word at 105 s,
    its GPU's Xid at 106 s: one outage); back from step 90 at 125 s; the run completed at
    step 140."""
    seed_run(database, "rg", job_id="7", started_at=_t(-10), created_at=_t(-40))
    with database.session() as s:
        s.add_all([*_steps("rg", range(1, 101), 1.0), *_steps("rg", range(91, 141), 125.0)])
        s.add_all([
            Event(run_id="rg", kind=EventKind.COLLECTIVE_ERROR, source="agent", rank=3,
                  occurred_at=_t(103), message="peer gone"),
            Event(run_id="rg", kind=EventKind.NODE_LOST, node="n2", occurred_at=_t(105),
                  fault_class=FaultClass.HARDWARE, message="n2 not responding", foreign=False),
            Event(run_id="rg", kind=EventKind.GPU_FAULT, node="n2", occurred_at=_t(106),
                  fault_class=FaultClass.HARDWARE, xid=79, message="Xid 79", foreign=False),
        ])  # fmt: skip


def test_an_outage_is_measured_once_training_is_back_and_the_views_add_it_up(
    database: Database, seed_run: Callable[..., None]
) -> None:
    _seed(database, seed_run)
    with database.session() as s:
        (measured,) = measure_failures(s, _t(200))
        assert (measured.kind, measured.reports) == (EventKind.NODE_LOST, 2)
    with database.session() as s:
        lost, xid = (s.query(Event).filter_by(run_id="rg", kind=kind).one()
                     for kind in (EventKind.NODE_LOST, EventKind.GPU_FAULT))  # fmt: skip
        # The truth: S = 100 ended at 100 s, step 101 at 135 s, one step is 1 s: 34 s lost.
        assert lost.time_lost_s == pytest.approx(34, abs=0.05)
        assert lost.lost_detection_s == pytest.approx(3, abs=0.05)  # the peer's word
        assert lost.lost_replay_s == pytest.approx(10, abs=0.05)
        assert lost.lost_restart_s == pytest.approx(21, abs=0.05)
        assert (lost.lost_queue_wait_s, lost.time_lost_estimate) == (0, False)
        assert lost.details["goodput"]["resumed_from"] == 90
        assert (xid.time_lost_s, xid.details["time_lost_counted_on"]) == (0, lost.id)
        run = s.get(Run, "rg")
        assert run is not None and run.first_step_at == _t(0)
        run.state, run.ended_at = RunState.COMPLETED, _t(180)
    with database.session() as s:  # the agent's word on the hang it ended, sent late
        s.add(Event(run_id="rg", kind=EventKind.HANG, node="n1", rank=0, source="agent",
                    occurred_at=_t(118), message="hung workers killed"))  # fmt: skip
    with database.session() as s:
        assert measure_failures(s, _t(300)) == []  # measured already: no second outage
        late = s.query(Event).filter_by(run_id="rg", kind=EventKind.HANG).one()
        assert (late.time_lost_s, late.details["time_lost_counted_on"]) == (0, lost.id)
        (row,) = read_view(s, "run_effective_time", run_id="rg")
        nodes = {r["node"]: r for r in read_view(s, "time_lost_by_node")}
        classes = {(r["fault_class"], r["kind"]): r for r in read_view(s, "time_lost_by_class")}
        (day,) = read_view(s, "time_lost_by_day")
    # Wall: first step's start (0 s) to the last step's end (174 s), not the daemon's end.
    assert row["wall_s"] == pytest.approx(174, abs=0.05)
    assert row["lost_s"] == pytest.approx(34, abs=0.05)
    assert row["effective_ratio"] == pytest.approx(140 / 174, abs=0.001)
    assert (row["failures"], row["unmeasured"], row["estimate"]) == (3, 0, 0)  # reports
    assert row["initial_wait_s"] == pytest.approx(30, abs=0.01)
    assert row["startup_s"] == pytest.approx(10, abs=0.01)
    assert nodes["n2"]["lost_s"] == pytest.approx(34, abs=0.05) and nodes["n2"]["failures"] == 2
    assert classes[("hardware", "node_lost")]["replay_s"] == pytest.approx(10, abs=0.05)
    assert (day["day"], day["runs"]) == ("2026-12-01", 1)


def test_a_node_loss_the_daemon_confirms_after_training_is_back_costs_what_its_peers_saw(
    database: Database, seed_run: Callable[..., None]
) -> None:
    """A spare, warm workers and the dead-peer eviction bring training back in seconds, before
    the daemon confirms the loss: the report belongs to the outage its peers saw, not to the
    training after it (measured alone, it cost nothing)."""
    seed_run(database, "rq", job_id="8", started_at=_t(-10), created_at=_t(-40))
    with database.session() as s:
        s.add_all([*_steps("rq", range(1, 101), 1.0), *_steps("rq", range(96, 141), 104.0)])
        s.add_all([
            Event(run_id="rq", kind=EventKind.COLLECTIVE_ERROR, source="agent", rank=3,
                  occurred_at=_t(100.2), message="peer gone"),
            Event(run_id="rq", kind=EventKind.PEER_DEAD, source="agent", node="n1",
                  occurred_at=_t(101.7), message="silent for 1.5 s"),
            Event(run_id="rq", kind=EventKind.NODE_LOST, node="n2", occurred_at=_t(109),
                  fault_class=FaultClass.HARDWARE, message="n2 lost", foreign=False),
        ])  # fmt: skip
    lost = _the_one_outage(database, "rq", EventKind.NODE_LOST)
    # S = 100 ended at 100 s, step 101 at 109 s, one step is 1 s: 8 s lost.
    assert lost.time_lost_s == pytest.approx(8, abs=0.05)
    assert lost.lost_detection_s == pytest.approx(0.2, abs=0.05)  # the peer's word
    assert lost.lost_replay_s == pytest.approx(5, abs=0.05)


def _the_one_outage(database: Database, run_id: str, kind: EventKind) -> Event:
    """The run's only outage (one report), measured by a goodput pass at 200 s, as stored."""
    with database.session() as s:
        (measured,) = measure_failures(s, _t(200))
        assert (measured.kind, measured.reports) == (kind, 1)
    with database.session() as s:
        head = s.query(Event).filter_by(run_id=run_id, kind=kind).one()
        s.expunge(head)
    return head


def test_a_dead_batch_host_is_measured_from_the_other_nodes_failed_torchrun(
    database: Database, seed_run: Callable[..., None]
) -> None:
    """A batch host that dies takes the rendezvous store with it: every other node's torchrun
    exits a second or so later, at times before any rank reports the dead peer (seen on the
    local cluster under load), and the daemon's own word (Slurm's, confirmed) comes seconds
    after that. The outage is detected at the first failed torchrun, not at the daemon's word."""
    seed_run(database, "rb", job_id="10", started_at=_t(-10), created_at=_t(-40))
    with database.session() as s:
        s.add_all([*_steps("rb", range(1, 101), 1.0), *_steps("rb", range(91, 141), 130.0)])
        s.add_all([
            Event(run_id="rb", kind=EventKind.LAUNCHER_FAILED, source="agent", node="n2",
                  occurred_at=_t(101.1), message="torchrun exited with 1"),
            Event(run_id="rb", kind=EventKind.LAUNCHER_FAILED, source="agent", node="n3",
                  occurred_at=_t(101.4), message="torchrun exited with 1"),
            Event(run_id="rb", kind=EventKind.BATCH_HOST_DOWN, node="n1", occurred_at=_t(104.5),
                  fault_class=FaultClass.HARDWARE, message="batch host n1 is down",
                  foreign=False),
        ])  # fmt: skip
    down = _the_one_outage(database, "rb", EventKind.BATCH_HOST_DOWN)
    # S = 100 ended at 100 s, step 101 at 140 s, one step is 1 s: 39 s lost.
    assert down.lost_detection_s == pytest.approx(1.1, abs=0.05)  # n2's torchrun
    assert down.time_lost_s == pytest.approx(39, abs=0.05)
    assert down.lost_replay_s == pytest.approx(10, abs=0.05)
    with database.session() as s:
        failed = s.query(Event).filter_by(run_id="rb", kind=EventKind.LAUNCHER_FAILED).all()
        assert [e.time_lost_s for e in failed] == [None, None]  # evidence, never charged


def test_an_outage_not_trained_past_waits_and_a_plain_script_gets_an_estimate(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "rw", job_id="8", started_at=_t(0))
    seed_run(database, "rp", job_id="9", started_at=_t(0))
    with database.session() as s:
        s.add_all(_steps("rw", range(1, 50), 1.0))
        s.add(Event(run_id="rw", kind=EventKind.HANG, node="n1", rank=1, occurred_at=_t(60),
                    message="rank 1 silent"))  # fmt: skip
        # The plain script writes a checkpoint file every 20 s (at 20 and 40 s, each found a
        # poll later); n3 is lost at 70 s; the job is requeued (waiting 9 s for Slurm), its
        # ranks run again at 95 s, and its next file is written at 117 s: it was back at 97 s.
        s.add_all([_file_event("rp", written) for written in (20, 40, 117)])
        s.add(Event(run_id="rp", kind=EventKind.NODE_LOST, node="n3", occurred_at=_t(70),
                    message="n3 lost"))  # fmt: skip
        s.add(Attempt(run_id="rp", number=2, slurm_job_id="9", submitted_at=_t(80),
                      started_at=_t(89)))  # fmt: skip
        s.add(Event(run_id="rp", kind=EventKind.RESTART, source="agent", node="n1",
                    occurred_at=_t(95), message="workers restarted"))  # fmt: skip
    with database.session() as s:
        # The plain script's outage; the hang is not trained past yet.
        assert [m.kind for m in measure_failures(s, _t(120))] == [EventKind.NODE_LOST]
        hang = s.query(Event).filter_by(run_id="rw", kind=EventKind.HANG).one()
        assert hang.time_lost_s is None
        plain = s.query(Event).filter_by(run_id="rp", kind=EventKind.NODE_LOST).one()
        # Back at 97 s (the next file, less the usual 20 s between files); the work since the
        # file written at 40 s redone.
        assert plain.time_lost_estimate is True
        assert (plain.lost_replay_s, plain.lost_queue_wait_s) == (30, 9)
        assert plain.lost_restart_s == pytest.approx(18)
        assert plain.time_lost_s == pytest.approx(57)
        (row,) = read_view(s, "run_effective_time", run_id="rp")
        assert row["estimate"] == 1


def _file_event(run_id: str, written_s: float) -> Event:
    """A checkpoint file written at ``written_s``, found by the batch step's poll 3 s later."""
    return Event(run_id=run_id, kind=EventKind.CHECKPOINT, source="agent",
                 occurred_at=_t(written_s + 3), message="checkpoint file",
                 details={"layout": "file", "label": f"plain-{written_s}.pt",
                          "ordinal": int(_t(written_s).timestamp() * 1e9)})  # fmt: skip


def test_a_plain_scripts_estimate_waits_for_the_cadence_of_its_files(
    database: Database, seed_run: Callable[..., None]
) -> None:
    """One file before the failure and one after: the gap between them spans the outage, so the
    cadence is not known until a second file after it (seen on the local cluster: measured at
    once, a failure late in an interval was put at 10.5 s, its step log said 15.9 s)."""
    seed_run(database, "rc", job_id="10", started_at=_t(0))
    with database.session() as s:
        # A file every 10 s from 20 s on; n2 lost at 38 s; its peers' ranks run again at 39 s,
        # and the files go on at 52, 62 s: it was back at 42 s.
        s.add_all([_file_event("rc", 20), _file_event("rc", 52)])
        s.add(Event(run_id="rc", kind=EventKind.NODE_LOST, node="n2", occurred_at=_t(38),
                    message="n2 lost"))  # fmt: skip
        s.add(Event(run_id="rc", kind=EventKind.RESTART, source="agent", node="n1",
                    occurred_at=_t(39), message="workers restarted"))  # fmt: skip
    with database.session() as s:
        assert measure_failures(s, _t(58)) == []
        s.add(_file_event("rc", 62))
    with database.session() as s:
        (measured,) = measure_failures(s, _t(68))
    assert measured.lost.estimate and measured.lost.back_at == _t(42)
    assert measured.lost.restart_s == pytest.approx(4)  # 38 s to 42 s
    assert measured.lost.replay_s == pytest.approx(18)  # the work since the file at 20 s


def _at(day: int, hour: float) -> datetime:
    return datetime(2026, 12, day, tzinfo=UTC) + timedelta(hours=hour)


def test_effective_time_per_utc_day_cuts_each_runs_span_at_midnight(
    database: Database, seed_run: Callable[..., None]
) -> None:
    # 22:00 to 02:00 across midnight, 12 minutes lost to a node at 23:00 on the first day.
    seed_run(database, "ra", running=False, state=RunState.COMPLETED, started_at=_at(1, 21.5),
             first_step_at=_at(1, 22), last_step_at=_at(2, 2), ended_at=_at(2, 2.1))
    # A plain script (no steps): its job's start to its end, an estimate.
    seed_run(database, "rb", running=False, state=RunState.FAILED, started_at=_at(2, 1),
             ended_at=_at(2, 3))
    # Still running: the day's figures grow until now.
    now = datetime.now(UTC)
    seed_run(database, "rc", started_at=now - timedelta(seconds=40),
             first_step_at=now - timedelta(seconds=30))
    with database.session() as s:
        s.add_all([
            Event(run_id="ra", kind=EventKind.NODE_LOST, node="n2", occurred_at=_at(1, 23),
                  message="n2 lost", time_lost_s=720, lost_detection_s=60, lost_restart_s=300,
                  lost_queue_wait_s=0, lost_replay_s=360, time_lost_estimate=False),
            # Neither is lost training time: evidence judged foreign, and a straggler.
            Event(run_id="ra", kind=EventKind.NODE_LOST, node="n4", occurred_at=_at(2, 1),
                  message="n4 not ours", time_lost_s=500, foreign=True),
            Event(run_id="ra", kind=EventKind.STRAGGLER, node="n3", occurred_at=_at(2, 1),
                  message="rank 2 slow", time_lost_s=90),
        ])  # fmt: skip
    with database.session() as s:
        days = {r["day"]: r for r in read_view(s, "effective_time_by_day")}
        (whole,) = read_view(s, "run_effective_time", run_id="ra")
    first, second = days.pop("2026-12-01"), days.pop("2026-12-02")
    assert first["wall_s"] == pytest.approx(7200, abs=0.01)
    assert (first["runs"], first["failures"], first["estimate"]) == (1, 1, 0)
    assert first["lost_s"] == pytest.approx(720)
    assert first["effective_s"] == pytest.approx(6480, abs=0.01)
    assert first["effective_ratio"] == pytest.approx(0.9, abs=1e-6)
    parts = ("detection_s", "restart_s", "queue_wait_s", "replay_s")
    assert [first[p] for p in parts] == pytest.approx([60, 300, 0, 360])
    # 2 h of "ra" after midnight and 2 h of "rb"; nothing lost.
    assert second["wall_s"] == pytest.approx(4 * 3600, abs=0.01)
    assert (second["runs"], second["failures"], second["estimate"]) == (2, 0, 1)
    assert (second["lost_s"], second["effective_ratio"]) == (0, pytest.approx(1.0))
    # The days of one run add up to its whole span.
    assert whole["wall_s"] == pytest.approx(first["wall_s"] + 7200, abs=0.01)
    # The running run's 30 s so far (on today, or on today and yesterday after midnight).
    assert sum(d["wall_s"] for d in days.values()) == pytest.approx(30, abs=5)
