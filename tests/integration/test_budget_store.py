"""The daemon's restart budget read from a real store: what the agents reported (restarts of
their workers, checkpoints, hangs) and what the daemon recorded (lost nodes, failed jobs).
Each pass as the daemon makes it: gather reads the evidence, decide counts, act records."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, text
from support.daemon_side import count_and_record

from slurmft.db import Database
from slurmft.db.models import Attempt, Event, EventKind, FaultClass, Run, utcnow
from slurmft.db.records import record_event
from slurmft.db.states import AttemptState

AGENTS = ("n1-a", "n2-b", "n3-c")


def _report(
    database: Database,
    kind: EventKind,
    at: datetime,
    source: str = "agent",
    rank: int | None = None,
    **details: Any,
) -> None:
    with database.session() as s:
        event = record_event(
            s, kind, kind.value, run_id="r1", rank=rank, source=source, details=details
        )
        event.recorded_at = at


def _restart_everywhere(database: Database, at: datetime) -> None:
    for i, agent in enumerate(AGENTS):
        _report(database, EventKind.RESTART, at + timedelta(seconds=i * 0.4), agent_id=agent)


def _run_restarts(database: Database) -> dict[str, int]:
    """The `run_restarts` view's counts for the run (docs/failure-history.md)."""
    with database.session() as s:
        row = s.execute(
            text("SELECT restarts, hardware, hang, user_code FROM run_restarts WHERE run_id = 'r1'")
        ).one()
    return dict(zip(("restarts", "hardware", "hang", "user_code"), row, strict=True))


def _budget(database: Database) -> tuple[int, datetime | None]:
    """One pass's count of the run's budget, recorded; what the store then holds."""
    budget, _ = count_and_record(database, "r1")
    with database.session() as s:
        run = s.get(Run, "r1")
        assert run is not None
        assert run.restarts_without_progress == budget.restarts_without_progress
        return run.restarts_without_progress, run.last_progress_at


def test_restarts_are_counted_once_per_round_and_reset_by_a_newer_checkpoint(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    start = utcnow()
    _report(database, EventKind.CHECKPOINT, start, step=5)
    for i in range(4):  # a script that crashes every 20 s, each round reported by 3 agents
        _restart_everywhere(database, start + timedelta(seconds=20 * (i + 1)))
    assert _budget(database) == (4, start)
    # The fifth failure counts when the survivors report their collective errors, before the
    # restart that follows it is reported.
    fifth = start + timedelta(seconds=100)
    for rank, agent in ((0, "n1-a"), (2, "n3-c")):
        _report(database, EventKind.COLLECTIVE_ERROR, fifth, rank=rank, agent_id=agent)
    assert _budget(database)[0] == 5
    _restart_everywhere(database, fifth + timedelta(seconds=15))
    assert _budget(database)[0] == 5
    _report(database, EventKind.CHECKPOINT, start + timedelta(seconds=120), step=5)
    assert _budget(database)[0] == 5  # the same checkpoint again is no progress
    newer = start + timedelta(seconds=130)
    _report(database, EventKind.CHECKPOINT, newer, step=10)
    assert _budget(database) == (0, newer)
    _restart_everywhere(database, newer + timedelta(seconds=20))
    assert _budget(database) == (1, newer)


def _file_checkpoint(database: Database, at: datetime, name: str, mtime_s: int) -> None:
    """What the batch step reports of a checkpoint a plain script wrote (file_checkpoint_event)."""
    from slurmft.agent.batch import file_checkpoint_event
    from slurmft.core.checkpoints import Checkpoint

    event = file_checkpoint_event(Checkpoint(name, "file", mtime_s * 10**9), at)
    _report(database, EventKind.CHECKPOINT, at, **event.details)


def test_a_plain_scripts_newer_checkpoint_file_resets_the_count_as_a_verified_one_would(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    start = utcnow()
    _file_checkpoint(database, start, "plain-000005.pt", 1_000)
    for i in range(3):
        _restart_everywhere(database, start + timedelta(seconds=20 * (i + 1)))
    assert _budget(database) == (3, start)
    again = start + timedelta(seconds=70)
    _file_checkpoint(database, again, "plain-000005.pt", 1_000)  # the same file: no progress
    assert _budget(database)[0] == 3
    newer = start + timedelta(seconds=80)
    _file_checkpoint(database, newer, "plain-000010.pt", 2_000)
    assert _budget(database) == (0, newer)


def test_file_checkpoints_are_ignored_for_a_run_whose_ranks_report_verified_ones(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    start = utcnow()
    _report(database, EventKind.CHECKPOINT, start, step=5)
    for i in range(2):
        _restart_everywhere(database, start + timedelta(seconds=20 * (i + 1)))
    _file_checkpoint(database, start + timedelta(seconds=50), "extra.pt", 9_000)
    _restart_everywhere(database, start + timedelta(seconds=60))
    assert _budget(database) == (3, start)


def test_reports_naming_a_round_count_once_per_round_however_they_interleave(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    start = utcnow()
    # Three quick failures: only one error reported, restarts reported by different agents,
    # and the first round's restart reported once more after the third failure.
    reports = [
        (EventKind.COLLECTIVE_ERROR, 0.0, "n1-a", "7.1/0"),
        (EventKind.RESTART, 0.3, "n2-b", "7.1/0"),
        (EventKind.RESTART, 4.0, "n3-c", "7.1/1"),
        (EventKind.RESTART, 8.0, "n1-a", "7.1/2"),
        (EventKind.RESTART, 8.2, "n3-c", "7.1/0"),
    ]
    for kind, seconds, agent, ended in reports:
        at = start + timedelta(seconds=seconds)
        _report(database, kind, at, rank=0, agent_id=agent, rdzv_round=ended)
    assert _budget(database)[0] == 3
    assert _budget(database)[0] == 3  # a second pass records nothing again
    with database.session() as s:
        counted = s.scalars(
            select(Event).where(Event.kind == EventKind.RESTART, Event.source == "daemon")
        ).all()
        assert sorted(e.details["restart_key"] for e in counted) == ["7.1/0", "7.1/1", "7.1/2"]
        assert {e.fault_class for e in counted} == {FaultClass.USER_CODE}
    assert _run_restarts(database) == {"restarts": 3, "hardware": 0, "hang": 0, "user_code": 3}


def test_a_restart_counted_before_its_node_loss_was_known_is_recorded_with_that_cause(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    start = utcnow()
    _report(database, EventKind.CHECKPOINT, start, step=5)
    failed = start + timedelta(seconds=10)
    _report(database, EventKind.COLLECTIVE_ERROR, failed, rank=0, agent_id="a", rdzv_round="7.1/0")
    assert _budget(database)[0] == 1
    assert _run_restarts(database) == {"restarts": 1, "hardware": 0, "hang": 0, "user_code": 1}
    # The spare trains and saves before Slurm calls the dead node DOWN.
    _report(database, EventKind.CHECKPOINT, start + timedelta(seconds=15), step=10)
    _report(database, EventKind.NODE_LOST, start + timedelta(seconds=18), source="daemon")
    assert _budget(database)[0] == 0
    assert _run_restarts(database) == {"restarts": 1, "hardware": 1, "hang": 0, "user_code": 0}


def test_a_lost_node_makes_its_restart_free_and_earlier_failed_jobs_count(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1", job_id="7")
    start = utcnow()
    with database.session() as s:
        first = s.scalars(select(Attempt).where(Attempt.run_id == "r1")).one()
        first.state, first.ended_at = AttemptState.FAILED, start
        s.add(Attempt(run_id="r1", number=2, slurm_job_id="8"))
    _report(database, EventKind.NODE_LOST, start + timedelta(seconds=30), source="daemon")
    _restart_everywhere(database, start + timedelta(seconds=22))  # survivors before the DOWN
    assert _budget(database) == (1, None)  # the failed first job; the node loss is free
    _report(database, EventKind.HANG, start + timedelta(seconds=200), stacks={"1": "..."})
    _restart_everywhere(database, start + timedelta(seconds=210))
    assert _budget(database) == (2, None)
    # The failure history counts each restart once, by its cause.
    assert _run_restarts(database) == {"restarts": 3, "hardware": 1, "hang": 1, "user_code": 1}
