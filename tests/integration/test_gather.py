"""Gathering the cluster view from a real store and replayed real Slurm output."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sqlalchemy import event, select
from support.slurm_recordings import ReplayRunner, recorded_jobs

from slurmft.controller.decide import Policy, TrustPolicy, decide, lemon_nodes
from slurmft.controller.observe import gather, observe, read_slurm
from slurmft.controller.reconcile import reconcile
from slurmft.controller.views import ExcludeNode, JobPhase, NotifyHuman, RequeueJob
from slurmft.db import Database
from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    Attempt,
    Event,
    EventKind,
    FaultClass,
    Run,
)
from slurmft.db.records import OBSERVE_ONLY
from slurmft.db.states import AttemptState, RunState
from slurmft.gpu.api import FaultAction
from slurmft.slurm.api import JobInfo
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.states import JobState

NOW = datetime.now(UTC)
JOB = recorded_jobs()[0]  # the recording's running job, later requeued


def _seed(database: Database) -> None:
    with database.session() as s:
        run = Run(
            id="r14",
            name="r14",
            owner_uid=0,
            owner_name="root",
            nodes=2,
            spares=1,
            command=["train.py"],
        )
        s.add(run)
        s.flush()
        run.state = RunState.RUNNING
        s.add(
            Attempt(
                run_id="r14", number=1, slurm_job_id=JOB, submitted_at=NOW - timedelta(minutes=10)
            )
        )
        # What the ingest endpoint wrote for an agent's report of an Xid 79 on n2, judged the
        # run's own (its job holds n2).
        s.add(
            Event(
                run_id="r14",
                kind=EventKind.GPU_FAULT,
                node="n2",
                xid=79,
                gpu_index=3,
                fault_class=FaultClass.HARDWARE,
                source="agent",
                message="Xid 79 GPU has fallen off the bus (GPU 3)",
                details={"action": FaultAction.DRAIN.value, "fault_kind": "xid"},
                foreign=False,
            )
        )
        # Restart-class Xids on n5 in two different earlier runs: a lemon.
        for other in ("old1", "old2"):
            s.add(
                Run(
                    id=other,
                    name=other,
                    owner_uid=0,
                    owner_name="root",
                    nodes=1,
                    command=["x"],
                    state=RunState.PENDING,
                )
            )
            s.flush()
            s.add(
                Event(
                    run_id=other,
                    kind=EventKind.GPU_FAULT,
                    node="n5",
                    xid=13,
                    source="agent",
                    foreign=False,  # judged the run's own
                    occurred_at=NOW - timedelta(days=1),
                )
            )


def test_gather_builds_the_view_and_the_drain_cap_holds(database: Database) -> None:
    _seed(database)
    # The job is COMPLETING after a requeue: it is read in detail too (scontrol's Restarts).
    runner = ReplayRunner(["squeue_requeued", "sinfo_nodes_drained", "show_job_requeued"])
    with database.session() as s:
        view = observe(s, CliSlurmClient(runner), now=NOW)
    assert runner.exhausted
    assert view.slurm_reachable and view.partition_nodes == 6
    # The Xids of the lemon window, every run's: decide judges n5 a lemon from them.
    assert lemon_nodes(view, TrustPolicy()) == {"n5"}
    run = next(r for r in view.runs if r.run_id == "r14")
    assert run.job is not None and run.job.phase is JobPhase.ACTIVE
    (fault,) = run.gpu_faults
    assert (fault.node, fault.action, fault.xid, fault.gpu) == ("n2", FaultAction.DRAIN, 79, 3)
    assert view.drained_nodes == 1  # n3 is draining with a slurmft reason in the recording
    actions = [a for a in decide(view, Policy()) if a.run_id == "r14"]
    # A second slurmft drain would pass 10% of a 6-node partition: refused, a human is told.
    # (n2 was one of the job's two nodes: the job is requeued without it.)
    assert [(type(a), getattr(a, "node", None)) for a in actions] == [
        (ExcludeNode, "n2"),
        (NotifyHuman, None),
        (RequeueJob, None),
        (NotifyHuman, None),
    ]
    assert "refused by the rate limits" in actions[1].reason


def test_slurm_unreachable_means_no_view(database: Database) -> None:
    _seed(database)
    runner = ReplayRunner(["squeue_unreachable"])
    with database.session() as s:
        # The run's attempt asks for its job, exactly what the recording asked for.
        view = observe(s, CliSlurmClient(runner), now=NOW)
    assert not view.slurm_reachable and view.runs == ()


def _running_attempt(database: Database, batch_host: str) -> None:
    with database.session() as s:
        run = Run(id="r14", name="r14", owner_uid=0, owner_name="root", nodes=2, command=["x"])
        s.add(run)
        s.flush()
        run.state = RunState.RUNNING
        s.add(
            Attempt(
                run_id="r14",
                number=1,
                slurm_job_id=JOB,
                state=AttemptState.RUNNING,
                batch_host=batch_host,
                submitted_at=NOW - timedelta(minutes=10),
            )
        )


def _attempts(database: Database) -> list[tuple[int, AttemptState, int]]:
    with database.session() as s:
        rows = s.scalars(select(Attempt).order_by(Attempt.number)).all()
        return [(a.number, a.state, a.slurm_restarts) for a in rows]


def test_a_requeue_seen_only_while_completing_opens_the_next_attempt(database: Database) -> None:
    # After `scontrol requeue` squeue says COMPLETING (no restart count) and the job may run
    # again within seconds, never seen PENDING: scontrol's Restarts=1 tells it was requeued.
    _running_attempt(database, batch_host="n1")
    runner = ReplayRunner(["squeue_requeued", "sinfo_nodes_drained", "show_job_requeued"])
    with database.session() as s:
        observe(s, CliSlurmClient(runner), now=NOW)
    assert runner.exhausted
    assert _attempts(database) == [(1, AttemptState.REQUEUED, 0), (2, AttemptState.SUBMITTED, 1)]
    with database.session() as s:
        assert s.get(Run, "r14").state is RunState.RECOVERING  # type: ignore[union-attr]


def test_a_requeue_first_seen_running_again_opens_a_running_attempt(database: Database) -> None:
    # The next attempt is read before it was ever inserted: its state must already be set.
    _running_attempt(database, batch_host="n1")
    again = JobInfo(JOB, JobState.RUNNING, nodes=("n2", "n3"), batch_host="n2", restarts=1)
    with database.session() as s:
        runs = {"r14": (s.get(Run, "r14"), s.scalars(select(Attempt)).one())}
        reconcile(s, runs, {JOB: again}, now=NOW)  # type: ignore[arg-type]
    assert _attempts(database) == [(1, AttemptState.REQUEUED, 0), (2, AttemptState.RUNNING, 1)]
    with database.session() as s:
        second = s.scalars(select(Attempt).where(Attempt.number == 2)).one()
        assert (second.batch_host, second.nodelist) == ("n2", "n2,n3")


def test_a_failed_keyed_action_is_decided_again_after_a_while(database: Database) -> None:
    _seed(database)
    with database.session() as s:
        for key, status, age_s in (
            ("resubmit:12", ActionStatus.FAILED, 10),  # failed just now: not again yet
            ("resubmit:13", ActionStatus.FAILED, 70),  # failed a while ago: retry
            ("gpu:7", ActionStatus.DONE, 70),  # done: never again
        ):
            s.add(
                Action(
                    run_id="r14",
                    kind=ActionKind.RESUBMIT,
                    reason="job ended",
                    evidence={"key": key},
                    status=status,
                    created_at=NOW - timedelta(seconds=age_s),
                )
            )
    runner = ReplayRunner(["squeue_requeued", "sinfo_nodes_drained", "show_job_requeued"])
    with database.session() as s:
        view = observe(s, CliSlurmClient(runner), now=NOW)
    run = next(r for r in view.runs if r.run_id == "r14")
    assert {"resubmit:12", "gpu:7"} <= run.reported
    assert "resubmit:13" not in run.reported


def test_gather_only_reads_and_reconcile_writes(database: Database) -> None:
    """The observe stage's one writer is reconcile: gather, which builds the view decide takes
    from the store, sends no INSERT, UPDATE or DELETE, whatever the run went through."""
    _seed(database)
    runner = ReplayRunner(["squeue_requeued", "sinfo_nodes_drained", "show_job_requeued"])
    written: list[str] = []

    def note_writes(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().split(None, 1)[0].upper() in {"INSERT", "UPDATE", "DELETE"}:
            written.append(statement)

    with database.session() as s:
        snapshot = read_slurm(s, CliSlurmClient(runner))
        assert snapshot is not None
        tracked = {run.id: (run, snapshot.attempts[run.id]) for run in snapshot.runs}
        event.listen(database.engine, "before_cursor_execute", note_writes)
        try:
            reconcile(s, tracked, snapshot.jobs, now=NOW)
            assert written, "the requeue in the recording is recorded"
            written.clear()
            view = gather(s, snapshot, now=NOW)
            s.flush()
        finally:
            event.remove(database.engine, "before_cursor_execute", note_writes)
    assert written == []
    assert any(r.run_id == "r14" for r in view.runs)


def test_attempted_drains_count_against_the_hourly_limit_not_only_done_ones(
    database: Database,
) -> None:
    """A drain refused for lack of operator rights, or failed, still counts: otherwise each pass
    tries the hour's allowance again (issue 14, item 4). Observe-only's records do not count."""
    _seed(database)
    with database.session() as s:
        for status, error, age_min in (
            (ActionStatus.DONE, None, 10),
            (ActionStatus.SKIPPED, "drain requested, not permitted: Invalid user id", 20),
            (ActionStatus.FAILED, "reason longer than 256 characters", 30),
            (ActionStatus.PLANNED, None, 1),  # the daemon died between plan and drain
            (ActionStatus.SKIPPED, OBSERVE_ONLY, 5),  # decided, never tried
            (ActionStatus.DONE, None, 90),  # outside the hour
        ):
            s.add(
                Action(
                    kind=ActionKind.DRAIN_NODE,
                    node="n9",
                    reason="slurmft: Xid 79",
                    status=status,
                    error=error,
                    created_at=NOW - timedelta(minutes=age_min),
                )
            )
    runner = ReplayRunner(["squeue_requeued", "sinfo_nodes_drained", "show_job_requeued"])
    with database.session() as s:
        view = observe(s, CliSlurmClient(runner), now=NOW)
    assert view.drains_last_hour == 4
    # Four drains an hour by default: the fault's drain becomes a notice to a person.
    actions = decide(replace(view, partition_nodes=100, drained_nodes=0), Policy())
    refused = [a for a in actions if isinstance(a, NotifyHuman)]
    assert [a.reason.split(":")[0] for a in refused if "rate limits" in a.reason] == [
        "drain of n2 refused by the rate limits"
    ]
