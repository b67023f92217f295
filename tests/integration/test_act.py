"""The executor against a real store (SQLite and PostgreSQL) and a Slurm client whose commands
are recorded; the same drain through the real local Slurm cluster is in test_act_slurm.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from sqlalchemy import select

from slurmft.controller import views as v
from slurmft.controller.act import OBSERVE_ONLY, Executor
from slurmft.controller.resubmit import OwnerSubmitter
from slurmft.db import Database
from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    Attempt,
    DenylistEntry,
    Event,
    EventKind,
    FaultClass,
    Run,
)
from slurmft.db.records import denied_nodes, record_event
from slurmft.db.states import AttemptState, RunState
from slurmft.slurm.api import JobInfo, SlurmError, SlurmPermissionDenied, SlurmUnreachable
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.runner import CommandResult
from slurmft.slurm.script import MAX_REASON_CHARS, TRUNCATED_MARK
from slurmft.slurm.states import JobState


class RecordingSlurm:
    """Records the calls the executor makes; can fail one operation with a given error. Every
    job is run r1's (root's, tagged `slurmft-run:r1`) unless ``jobs`` says otherwise: what the
    executor checks before it cancels or requeues one (as scontrol reports it)."""

    def __init__(
        self, fail: dict[str, SlurmError] | None = None, jobs: dict[str, JobInfo] | None = None
    ) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail = fail or {}
        self.jobs = jobs or {}

    def job(self, job_id: str) -> JobInfo:
        default = JobInfo(job_id, JobState.RUNNING, comment="slurmft-run:r1", user_id=0)
        return self.jobs.get(job_id, default)

    def _call(self, name: str, *args: str) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise self.fail[name]

    def drain(self, node: str, reason: str) -> None:
        self._call("drain", node, reason)

    def requeue(self, job_id: str, exclude: Sequence[str] | None = None) -> None:
        self._call("requeue", job_id, *([",".join(exclude)] if exclude is not None else []))

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._call("set_excluded_nodes", job_id, ",".join(nodes))

    def cancel(self, job_id: str) -> None:
        self._call("cancel", job_id)


@pytest.fixture
def run_id(database: Database, seed_run: Callable[..., None]) -> str:
    seed_run(database, "r1")
    return "r1"


def _actions(database: Database) -> list[tuple[ActionKind, str | None, ActionStatus, str | None]]:
    with database.session() as s:
        rows = s.scalars(select(Action).order_by(Action.id)).all()
        return [(a.kind, a.node, a.status, a.error) for a in rows]


XID79 = "slurmft: Xid 79 GPU has fallen off the bus (GPU 3)"


def test_gpu_fault_is_recorded_excluded_and_drained(database: Database, run_id: str) -> None:
    slurm = RecordingSlurm()
    outcomes = Executor(database, slurm).execute(
        [  # type: ignore[arg-type]
            v.RecordEvent(
                run_id,
                XID79,
                {"xid": 79},
                kind=EventKind.GPU_FAULT,
                fault_class=FaultClass.HARDWARE,
                node="n2",
                key="gpu:n2:3:79",
            ),
            v.ExcludeNode(run_id, XID79, node="n2"),
            v.DrainNode(run_id, XID79, {"xid": 79}, node="n2"),
        ]
    )
    assert [o.status for o in outcomes] == [ActionStatus.DONE] * 3
    assert slurm.calls == [("drain", "n2", XID79)]
    assert _actions(database) == [
        (ActionKind.AGENT_LEAVE, "n2", ActionStatus.DONE, None),
        (ActionKind.DRAIN_NODE, "n2", ActionStatus.DONE, None),
    ]
    with database.session() as s:
        assert denied_nodes(s) == {"n2"}
        event = s.scalars(select(Event)).one()
        assert (event.kind, event.details) == (
            EventKind.GPU_FAULT,
            {"xid": 79, "key": "gpu:n2:3:79"},
        )


def _own_evidence(database: Database, run_id: str, node: str, *, foreign: bool) -> None:
    """An agent's Xid 79 report on ``node``, judged the run's own or foreign."""
    with database.session() as s:
        record_event(
            s,
            EventKind.GPU_FAULT,
            XID79,
            run_id=run_id,
            node=node,
            xid=79,
            source="agent",
            foreign=foreign,
        )


def test_drain_without_privilege_is_recorded_as_requested(database: Database, run_id: str) -> None:
    _own_evidence(database, run_id, "n2", foreign=False)
    slurm = RecordingSlurm(fail={"drain": SlurmPermissionDenied("Access/permission denied")})
    (outcome,) = Executor(database, slurm).execute(  # type: ignore[arg-type]
        [v.DrainNode(run_id, XID79, node="n2")]
    )
    assert outcome.status is ActionStatus.SKIPPED
    (kind, node, status, error), notice = _actions(database)
    assert (kind, node, status) == (ActionKind.DRAIN_NODE, "n2", ActionStatus.SKIPPED)
    assert error == "drain requested, not permitted: Access/permission denied"
    assert notice[:3] == (ActionKind.NOTIFY, None, ActionStatus.DONE)  # a person must drain it


@pytest.mark.parametrize("evidence", ["none", "foreign", "another run's"])
def test_a_drain_no_own_evidence_names_is_not_done(
    database: Database, run_id: str, seed_run: Callable[..., None], evidence: str
) -> None:
    """Only a node the run's own (judged) evidence names is drained for everyone: no Slurm
    drain, no denylist entry (which would tell every run's agent there to leave)."""
    if evidence == "foreign":
        _own_evidence(database, run_id, "n2", foreign=True)
    elif evidence == "another run's":
        seed_run(database, "r2")
        _own_evidence(database, "r2", "n2", foreign=False)
    slurm = RecordingSlurm()
    (outcome,) = Executor(database, slurm).execute(  # type: ignore[arg-type]
        [v.DrainNode(run_id, XID79, node="n2")]
    )
    assert outcome.status is ActionStatus.SKIPPED
    assert outcome.error == f"no evidence of run {run_id} names n2"
    assert slurm.calls == []
    with database.session() as s:
        assert denied_nodes(s) == set()
    assert _actions(database)[-1][:3] == (ActionKind.NOTIFY, None, ActionStatus.DONE)


def test_slurm_down_fails_one_action_and_the_next_still_runs(
    database: Database, run_id: str
) -> None:
    slurm = RecordingSlurm(fail={"requeue": SlurmUnreachable("slurmctld not responding")})
    outcomes = Executor(database, slurm).execute(
        [  # type: ignore[arg-type]
            v.RequeueJob(run_id, "batch host down", job_id="7", exclude=frozenset({"n1", "n9"})),
            v.NotifyHuman(run_id, "spares exhausted"),
        ]
    )
    assert [o.status for o in outcomes] == [ActionStatus.FAILED, ActionStatus.DONE]
    assert slurm.calls == [("requeue", "7", "n1,n9")]
    assert _actions(database)[0][3] == "slurmctld not responding"


def test_requeue_excludes_the_nodes_in_one_client_call(database: Database, run_id: str) -> None:
    # The client sets ExcNodeList as the requeued job completes (it cannot start before).
    slurm = RecordingSlurm()
    Executor(database, slurm).execute(  # type: ignore[arg-type]
        [v.RequeueJob(run_id, "no spare", job_id="7", exclude=frozenset({"n3", "n1"}))]
    )
    assert slurm.calls == [("requeue", "7", "n1,n3")]


def test_a_waiting_jobs_excluded_nodes_are_set_only_on_the_runs_own_job(
    database: Database, run_id: str
) -> None:
    others = {"8": JobInfo("8", JobState.PENDING, comment="slurmft-run:r1", user_id=15002)}
    slurm = RecordingSlurm(jobs=others)
    outcomes = Executor(database, slurm).execute(  # type: ignore[arg-type]
        [
            v.ExcludeFromJob(run_id, "keep n2 out", job_id="7", nodes=frozenset({"n2", "n9"})),
            v.ExcludeFromJob(run_id, "keep n2 out", job_id="8", nodes=frozenset({"n2"})),
        ]
    )
    assert slurm.calls == [("set_excluded_nodes", "7", "n2,n9")]
    assert [o.status for o in outcomes] == [ActionStatus.DONE, ActionStatus.SKIPPED]
    assert [a[0] for a in _actions(database)][:2] == [ActionKind.EXCLUDE_NODES] * 2


def test_a_job_slurm_says_is_not_the_runs_is_never_requeued_or_cancelled(
    database: Database, run_id: str
) -> None:
    """A job id in the store is a claim; Slurm's owner and comment decide before the daemon
    uses its rights on it (a user who attached another user's job, a stale record)."""
    others = {
        "7": JobInfo("7", JobState.RUNNING, comment="slurmft-run:r1", user_id=15002),
        "8": JobInfo("8", JobState.RUNNING, comment="slurmft-run:r9", user_id=0),
    }
    slurm = RecordingSlurm(jobs=others)
    stop = "crash loop: 5 restarts in a row without progress"
    outcomes = Executor(database, slurm).execute(  # type: ignore[arg-type]
        [
            v.RequeueJob(run_id, "batch host down", job_id="7", exclude=frozenset({"n1"})),
            v.FinishRun(run_id, stop, state=RunState.STOPPED, job_id="8"),
        ]
    )
    assert slurm.calls == []  # neither job touched
    assert [o.status for o in outcomes] == [ActionStatus.SKIPPED, ActionStatus.DONE]
    assert outcomes[0].error == "not touched: job 7 belongs to uid 15002, the run to uid 0"
    notices = [a for a in _actions(database) if a[0] is ActionKind.NOTIFY]
    assert len(notices) == 2  # a person is told of each
    with database.session() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state is RunState.STOPPED
        assert run.end_reason == (
            f"{stop} (job 8 not touched: job 8 is tagged with run r9, not run r1)"
        )


def test_restart_workers_waits_in_the_outbox(database: Database, run_id: str) -> None:
    (outcome,) = Executor(database, RecordingSlurm()).execute(  # type: ignore[arg-type]
        [v.RestartWorkers(run_id, "slurmft: hang rank 1", node="n2")]
    )
    assert outcome.status is ActionStatus.PLANNED
    assert _actions(database) == [(ActionKind.RESTART_WORKERS, "n2", ActionStatus.PLANNED, None)]


def test_stop_at_the_cap_cancels_the_job_and_ends_the_run(database: Database, run_id: str) -> None:
    slurm = RecordingSlurm()
    reason = "crash loop: 5 restarts in a row without progress"
    Executor(database, slurm).execute(  # type: ignore[arg-type]
        [v.FinishRun(run_id, reason, state=RunState.STOPPED, job_id="7")]
    )
    assert slurm.calls == [("cancel", "7")]
    with database.session() as s:
        run = s.get(Run, run_id)
        assert run is not None and (run.state, run.end_reason) == (RunState.STOPPED, reason)
    assert _actions(database)[0][:3] == (ActionKind.STOP_RUN, None, ActionStatus.DONE)


def test_resubmit_without_a_way_to_submit_waits_for_the_owner_and_tells_a_human(
    database: Database, run_id: str
) -> None:
    (outcome,) = Executor(database, RecordingSlurm()).execute(  # type: ignore[arg-type]
        [v.SubmitAttempt(run_id, "time limit", exclude=frozenset())]
    )
    assert outcome.status is ActionStatus.SKIPPED
    assert outcome.error is not None and "waiting for the owner" in outcome.error
    resubmit, notice = _actions(database)
    assert resubmit[:3] == (ActionKind.RESUBMIT, None, ActionStatus.SKIPPED)
    assert notice[:3] == (ActionKind.NOTIFY, None, ActionStatus.DONE)


def test_resubmit_opens_the_next_attempt_with_the_new_job(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r2", job_id="7")
    submitted: list[tuple[str, frozenset[str]]] = []

    def submit(run: Run, exclude: frozenset[str], action_id: int) -> str:
        submitted.append((run.id, exclude))
        return "8"

    (outcome,) = Executor(database, RecordingSlurm(), submit_attempt=submit).execute(  # type: ignore[arg-type]
        [v.SubmitAttempt("r2", "job 7 ended (time_limit)", exclude=frozenset({"n4"}))]
    )
    assert outcome.status is ActionStatus.DONE
    assert submitted == [("r2", frozenset({"n4"}))]
    with database.session() as s:
        attempts = s.scalars(select(Attempt).order_by(Attempt.number)).all()
        assert [(a.number, a.slurm_job_id) for a in attempts] == [(1, "7"), (2, "8")]
        assert attempts[1].state is AttemptState.SUBMITTED
        run = s.get(Run, "r2")
        assert run is not None and run.state is RunState.RECOVERING


def test_a_failed_submission_charges_nothing_until_a_job_exists(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r3", job_id="7")
    action = v.SubmitAttempt(
        "r3", "job 7 ended (failed)", exclude=frozenset(), restarts_without_progress=3
    )

    def refused(run: Run, exclude: frozenset[str], action_id: int) -> str:
        raise SlurmUnreachable("slurmctld not responding")

    (outcome,) = Executor(database, RecordingSlurm(), submit_attempt=refused).execute([action])  # type: ignore[arg-type]
    assert outcome.status is ActionStatus.FAILED
    with database.session() as s:
        run = s.get(Run, "r3")
        assert run is not None and run.restarts_without_progress == 0

    def submitted(run: Run, exclude: frozenset[str], action_id: int) -> str:
        return "8"

    Executor(database, RecordingSlurm(), submit_attempt=submitted).execute([action])  # type: ignore[arg-type]
    with database.session() as s:
        run = s.get(Run, "r3")
        assert run is not None and run.restarts_without_progress == 3


def test_a_webhook_leaves_notices_in_the_outbox(database: Database, run_id: str) -> None:
    outcomes = Executor(database, RecordingSlurm(), webhook=True).execute(  # type: ignore[arg-type]
        [v.NotifyHuman(run_id, "drain of n2 refused by the rate limits")]
    )
    assert [o.status for o in outcomes] == [ActionStatus.PLANNED]
    assert _actions(database) == [(ActionKind.NOTIFY, None, ActionStatus.PLANNED, None)]


def test_observe_only_records_everything_and_acts_on_nothing(
    database: Database, run_id: str
) -> None:
    slurm = RecordingSlurm()
    outcomes = Executor(database, slurm, observe_only=True).execute(
        [  # type: ignore[arg-type]
            v.RecordEvent(run_id, XID79, kind=EventKind.GPU_FAULT, node="n2"),
            v.ExcludeNode(run_id, XID79, node="n2"),
            v.DrainNode(run_id, XID79, node="n2"),
            v.RequeueJob(run_id, "x", job_id="7"),
            v.FinishRun(run_id, "cap", state=RunState.STOPPED, job_id="7"),
        ]
    )
    assert slurm.calls == []
    assert [o.status for o in outcomes] == [ActionStatus.DONE] + [ActionStatus.SKIPPED] * 4
    assert {a[2] for a in _actions(database)} == {ActionStatus.SKIPPED}
    assert {a[3] for a in _actions(database)} == {OBSERVE_ONLY}
    with database.session() as s:
        assert denied_nodes(s, run_id=run_id) == frozenset()
        run = s.get(Run, run_id)
        assert run is not None and run.state is RunState.RUNNING
        assert s.scalars(select(Event)).one().kind is EventKind.GPU_FAULT


def test_observe_only_still_records_the_end_of_a_run_whose_job_ended(
    database: Database, run_id: str
) -> None:
    # Without it the run stays live in the store and the same end is decided every pass.
    slurm = RecordingSlurm()
    (outcome,) = Executor(database, slurm, observe_only=True).execute(  # type: ignore[arg-type]
        [v.FinishRun(run_id, "the training script finished", state=RunState.COMPLETED)]
    )
    assert slurm.calls == [] and outcome.status is ActionStatus.DONE
    assert _actions(database) == [(ActionKind.FINISH_RUN, None, ActionStatus.DONE, None)]
    with database.session() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state is RunState.COMPLETED
        # Its wall time ends with it: run_effective_time no longer grows with every query.
        assert run.ended_at is not None and run.ended_at >= run.created_at


def test_observe_only_records_a_repeated_decision_once(database: Database, run_id: str) -> None:
    # A dead batch host stays dead while nothing is done: the same pair comes every pass.
    reason = "slurmft: batch host n1 of job 7 is down"
    decided = [
        v.ExcludeNode(run_id, reason, node="n1"),
        v.RequeueJob(run_id, reason, job_id="7", exclude=frozenset({"n1"})),
    ]
    executor = Executor(database, RecordingSlurm(), observe_only=True)  # type: ignore[arg-type]
    for _ in range(3):
        outcomes = executor.execute(decided)
        assert {o.status for o in outcomes} == {ActionStatus.SKIPPED}
    assert _actions(database) == [
        (ActionKind.AGENT_LEAVE, "n1", ActionStatus.SKIPPED, OBSERVE_ONLY),
        (ActionKind.REQUEUE, None, ActionStatus.SKIPPED, OBSERVE_ONLY),
    ]
    executor.execute([v.ExcludeNode(run_id, "slurmft: node n2 lost (active)", node="n2")])
    assert len(_actions(database)) == 3  # a new decision is a new row


# --- one run's failure stays in that run (issue 14, item 3) -----------------------------------


def _run_state(database: Database, run_id: str) -> RunState:
    with database.session() as s:
        run = s.get(Run, run_id)
        assert run is not None
        return run.state


def test_a_mistyped_submission_record_is_refused_for_its_run_and_later_runs_still_act(
    database: Database, seed_run: Callable[..., None]
) -> None:
    record = {
        "script": "#!/bin/bash\nexec true\n",
        "job_name": "slurmft-a",
        "run_id": "ra",
        "nodes": "2",  # a string: sbatch's argv would compare it with 1 and raise
        "exclude": [],
    }
    seed_run(database, "ra", job_id="7", submission=record)
    seed_run(database, "rb", job_id="8")
    outcomes = Executor(
        database, RecordingSlurm(), submit_attempt=OwnerSubmitter(slurm_conf=None, timeout_s=5)
    ).execute(  # type: ignore[arg-type]
        [
            v.SubmitAttempt("ra", "job 7 ended (time_limit)", {"key": "resubmit:7"}),
            v.FinishRun("rb", "the training script finished", state=RunState.COMPLETED),
        ]
    )
    assert [o.status for o in outcomes] == [ActionStatus.SKIPPED, ActionStatus.DONE]
    assert outcomes[0].error == ("the recorded submission's 'nodes' is str '2', expected int")
    assert _run_state(database, "rb") is RunState.COMPLETED


def test_an_unexpected_error_in_one_runs_action_is_its_failed_row_and_the_rest_go_on(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "ra", job_id="7")
    seed_run(database, "rb", job_id="8")

    def broken(run: Run, exclude: frozenset[str], action_id: int) -> str:
        raise KeyError("partition")  # a bug, not a Slurm error

    outcomes = Executor(database, RecordingSlurm(), submit_attempt=broken).execute(  # type: ignore[arg-type]
        [
            v.SubmitAttempt("ra", "job 7 ended (failed)", {"key": "resubmit:7"}),
            v.FinishRun("rb", "the training script finished", state=RunState.COMPLETED),
        ]
    )
    assert [o.status for o in outcomes] == [ActionStatus.FAILED, ActionStatus.DONE]
    with database.session() as s:
        failed = s.scalars(select(Action).where(Action.run_id == "ra")).one()
        assert (failed.kind, failed.status) == (ActionKind.RESUBMIT, ActionStatus.FAILED)
        assert failed.error == "internal error: KeyError: 'partition'"
        assert failed.evidence == {"key": "resubmit:7"}  # decided again after a while
        assert s.scalars(select(Attempt).where(Attempt.run_id == "ra")).one().number == 1
    assert _run_state(database, "rb") is RunState.COMPLETED


# --- drains: refused ones leave nothing global, reasons fit Slurm (issue 14, item 4) -----------


def test_a_refused_drain_leaves_no_global_denylist_entry(database: Database, run_id: str) -> None:
    slurm = RecordingSlurm(fail={"drain": SlurmPermissionDenied("Access/permission denied")})
    outcomes = Executor(database, slurm).execute(  # type: ignore[arg-type]
        [v.ExcludeNode(run_id, XID79, node="n2"), v.DrainNode(run_id, XID79, node="n2")]
    )
    assert [o.status for o in outcomes] == [ActionStatus.DONE, ActionStatus.SKIPPED]
    with database.session() as s:
        assert denied_nodes(s) == frozenset()  # every other run may still use n2
        assert denied_nodes(s, run_id=run_id) == {"n2"}  # the run that saw the fault may not


class AcceptingRunner:
    """Slurm's CLI that accepts every command, and records the argv it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        self.calls.append(tuple(argv))
        return CommandResult(tuple(argv), 0, "", "")


def test_a_long_drain_reason_is_cut_for_slurm_and_kept_whole_in_its_row(
    database: Database, run_id: str
) -> None:
    reason = "slurmft: Xid 79 GPU has fallen off the bus: " + "detail " * 80 + "\nend"
    _own_evidence(database, run_id, "n2", foreign=False)
    runner = AcceptingRunner()
    (outcome,) = Executor(database, CliSlurmClient(runner)).execute(
        [v.DrainNode(run_id, reason, node="n2")]
    )
    assert outcome.status is ActionStatus.DONE
    (argv,) = runner.calls
    sent = next(arg for arg in argv if arg.startswith("Reason=")).removeprefix("Reason=")
    assert len(sent) <= MAX_REASON_CHARS and sent.endswith(TRUNCATED_MARK)
    assert sent.startswith("slurmft: Xid 79 GPU has fallen off the bus: detail")
    with database.session() as s:
        row = s.scalars(select(Action)).one()
        assert (row.reason, row.status) == (reason, ActionStatus.DONE)
        assert denied_nodes(s) == {"n2"}


# --- only node names enter the denylist and exclude lists (issue 14, item 5) -------------------


def test_a_name_that_is_no_node_name_never_enters_the_denylist_or_reaches_slurm(
    database: Database, run_id: str
) -> None:
    slurm = RecordingSlurm()
    outcomes = Executor(database, slurm).execute(  # type: ignore[arg-type]
        [
            v.ExcludeNode(run_id, XID79, node="n1,n2"),
            v.DrainNode(run_id, XID79, node="n[1-3]"),
            v.ExcludeNode(run_id, XID79, node="n4"),
        ]
    )
    assert [o.status for o in outcomes] == [
        ActionStatus.FAILED,
        ActionStatus.FAILED,
        ActionStatus.DONE,
    ]
    assert outcomes[0].error is not None and "not a Slurm node name: 'n1,n2'" in outcomes[0].error
    assert slurm.calls == []
    with database.session() as s:
        assert denied_nodes(s, run_id=run_id) == {"n4"}


def test_an_invalid_name_already_denylisted_is_left_out_of_every_exclude_list(
    database: Database, run_id: str
) -> None:
    with database.session() as s:  # written before names were checked
        s.add_all(
            [
                DenylistEntry(node="n3", reason="slurmft: Xid 79"),
                DenylistEntry(node="n[1-6]", reason="posted by an agent"),
                DenylistEntry(node="n5 --exclude", reason="posted", run_id=run_id),
            ]
        )
    with database.session() as s:  # what gather puts into the view, and create_run gives sbatch
        assert denied_nodes(s, run_id=run_id) == {"n3"}
