"""The attempt's allocation, as Slurm has it, and the judging of the run's evidence against it.

The batch step reports its Slurm job and the nodes it runs the agent step on, with their roles
(protocol.AllocationReport), under the run's token: ingest stores that as an `allocation` event,
not judged (`foreign` NULL). Each control pass, after reconcile, judges the reports here: the
job must be the run owner's and tagged with the run (Slurm's record, slurmft.slurm.script
.not_the_runs_job), and be the run's latest attempt's job, or adoptable as it (an attempt whose
job `slurmft submit` never attached). The allocation stored (`allocation_nodes`, with join and
leave times) is the reported nodes that Slurm says the job holds, or that its live steps still
run on (a node lost before the report was judged: `check_report`): the poster's word only picks
the roles, and which of the job's nodes the agent step runs on. A report that does not check out
is marked foreign and refused with a daemon event saying why; nothing of it is stored.

Then every agent event not judged yet is judged against its attempt's allocation, once that is
known: naming a node outside it (or one that had left it when the event came) makes it foreign,
and so does coming before the job started (Slurm's StartTime, less a minute for the clocks): no
agent of the job could have sent it, so it is a claim about nodes the run did not have yet
(seen in the hostile-user test: a run that waited in Slurm posted faults naming nodes, and
when its job later started on them, the held faults read as its own). Foreign evidence is never
acted on (observe reads only `foreign` false). Until the allocation is known the evidence is
held.

Why here and not in ingest: checking a report asks Slurm (scontrol, a second or more when
slurmctld is busy), and ingest answers every agent's batch every second from one group writer
that must never wait on Slurm; the control pass asks Slurm anyway, and judges before it gathers,
so evidence that comes with its allocation is acted on in the same pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import msgspec
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from slurmft.controller.pass_health import PassFailures, is_held
from slurmft.db.models import AllocationNode, Attempt, Event, EventKind, NodeRole, Run
from slurmft.db.records import record_event
from slurmft.db.states import AttemptState
from slurmft.protocol import AllocationMember, JobId
from slurmft.slurm.api import JobInfo, SlurmClient, SlurmError, SlurmTimeout, SlurmUnreachable
from slurmft.slurm.script import not_the_runs_job

REFUSED = "allocation report refused"
# How far the daemon's clock may be behind slurmctld's when it compares an event's arrival with
# the job's start (both hosts keep NTP time; Slurm prints whole seconds).
START_SKEW = timedelta(seconds=60)


@dataclass(frozen=True)
class Verdict:
    """A report checked against Slurm: the nodes to store (with roles) or why it is refused;
    ``wait``: not judged yet (the job was requeued, reconcile has not opened the attempt)."""

    members: Mapping[str, NodeRole] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()  # reported, but Slurm does not give the job these
    refused: str | None = None
    wait: bool = False


def check_report(
    job: JobInfo,
    claimed: Mapping[str, NodeRole],
    run: Run,
    attempt: Attempt | None,
    step_nodes: frozenset[str] = frozenset(),
) -> Verdict:
    """What Slurm's record of the reported job makes of the report. Pure. ``step_nodes``: the
    nodes Slurm says the job's live steps were launched on (asked only when the report names
    nodes the job no longer holds)."""
    problem = not_the_runs_job(job, run.id, run.owner_uid)
    if problem is not None:
        return Verdict(refused=problem)
    if attempt is not None and attempt.slurm_job_id not in (None, job.job_id):
        return Verdict(refused=f"job {job.job_id} is not the attempt's job {attempt.slurm_job_id}")
    if attempt is not None and job.restarts > attempt.slurm_restarts:
        return Verdict(wait=True)  # requeued since: the report is the next attempt's
    if not job.state.holds_nodes:
        return Verdict(refused=f"job {job.job_id} holds no nodes ({job.state.value})")
    # A node the job lost before this report was judged (the daemon was down when the job
    # started: it never saw the whole allocation) is no longer in the job's record, but its
    # agent step's record still names it: the job had it, and the node is stored, to be seen
    # lost by the next observation.
    had = set(job.nodes) | step_nodes
    members = {node: role for node, role in claimed.items() if node in had}
    if not members:
        return Verdict(refused=f"job {job.job_id} holds none of the reported nodes")
    return Verdict(members=members, ignored=tuple(sorted(set(claimed) - had)))


def judge_allocation_reports(
    session: Session,
    slurm: SlurmClient,
    *,
    now: datetime,
    failures: PassFailures | None = None,
) -> None:
    """Judge every batch step report not judged yet (one scontrol call each). Each is judged in
    isolation: one that fails (a bug, a stored value nobody expected) is recorded on its run
    (and in ``failures``) and stays unjudged; the others go on. A held run's reports wait."""
    failures = PassFailures() if failures is None else failures
    reports = session.scalars(
        select(Event)
        .where(
            Event.kind == EventKind.ALLOCATION,
            Event.source == "agent",
            Event.foreign.is_(None),
        )
        .order_by(Event.id)
    ).all()
    for report in reports:
        run = session.get(Run, report.run_id) if report.run_id else None
        if run is not None and is_held(run):
            continue
        try:
            _judge_report(session, slurm, report, run, now)
        except (SlurmUnreachable, SlurmTimeout):
            return  # judged on a later pass
        except SQLAlchemyError:
            raise  # the store's failure, not this run's: the pass is skipped for everyone
        except Exception as exc:
            if run is None:
                raise  # a report without a run is refused before anything can fail
            failures.record(session, run.id, f"judging allocation report {report.id}", exc)
    session.flush()


def _judge_report(
    session: Session, slurm: SlurmClient, report: Event, run: Run | None, now: datetime
) -> None:
    """One report: refused, stored as the attempt's allocation, or left for a later pass.
    Everything that may fail is worked out before its first write."""
    if run is None or run.state.is_terminal:
        _refuse(session, report, "the run has ended")
        return
    claim = stored_claim(report.details)
    if isinstance(claim, str):
        _refuse(session, report, claim)
        return
    job_id, claimed = claim
    try:
        job = slurm.job(job_id)
    except (SlurmUnreachable, SlurmTimeout):
        raise
    except SlurmError as error:  # not a job id, or no such job
        _refuse(session, report, f"Slurm: {error}")
        return
    step_nodes = _step_nodes(slurm, job, claimed)
    attempt = _latest_attempt(session, run.id)
    verdict = check_report(job, claimed, run, attempt, step_nodes)
    if verdict.wait:
        return
    if verdict.refused is not None:
        _refuse(session, report, verdict.refused)
        return
    started = slurm_start_time(job)
    attempt = _adopt(session, run, attempt, job, now)
    if started is not None and (attempt.started_at is None or started < attempt.started_at):
        attempt.started_at = started  # Slurm's, not the first pass that saw it running
    _store(attempt, verdict.members, now, f"not in the batch step's report {report.id}")
    report.attempt_id = attempt.id
    report.foreign = False
    report.details = {
        **report.details,
        "allocation": sorted(verdict.members),
        "ignored": list(verdict.ignored),
    }


def _step_nodes(
    slurm: SlurmClient, job: JobInfo, claimed: Mapping[str, NodeRole]
) -> frozenset[str]:
    """The nodes of the job's live steps, asked of Slurm only when the report names a node the
    job no longer holds (one squeue call; rare)."""
    if not job.state.holds_nodes or set(claimed) <= set(job.nodes):
        return frozenset()
    try:
        return slurm.step_nodes(job.job_id)
    except (SlurmUnreachable, SlurmTimeout):
        raise
    except SlurmError:  # no steps to ask about: the held nodes alone decide
        return frozenset()


def judge_evidence(
    session: Session, run_ids: list[str], failures: PassFailures | None = None
) -> None:
    """Mark each agent event of these runs not judged yet as the run's own or foreign, where its
    attempt's allocation is known; the rest stays held. A run whose judging fails is recorded
    (and in ``failures``); the others go on."""
    failures = PassFailures() if failures is None else failures
    for run_id in run_ids:
        try:
            _judge_run_evidence(session, run_id)
        except SQLAlchemyError:
            raise  # the store's failure, not this run's: the pass is skipped for everyone
        except Exception as exc:
            failures.record(session, run_id, "judging its evidence", exc)
    session.flush()


def _judge_run_evidence(session: Session, run_id: str) -> None:
    events = session.scalars(
        select(Event).where(
            Event.run_id == run_id,
            Event.source == "agent",
            Event.foreign.is_(None),
            Event.kind != EventKind.ALLOCATION,
        )
    ).all()
    if not events:
        return
    latest = _latest_attempt(session, run_id)
    cache: dict[int, dict[str, AllocationNode]] = {}
    for event in events:
        attempt_id = event.attempt_id or (latest.id if latest else None)
        if attempt_id is None:
            continue
        if attempt_id not in cache:
            cache[attempt_id] = {
                row.node: row
                for row in session.scalars(
                    select(AllocationNode).where(AllocationNode.attempt_id == attempt_id)
                )
            }
        allocation = cache[attempt_id]
        if not allocation:
            continue  # not known yet: held
        attempt = session.get(Attempt, attempt_id)
        started = attempt.started_at if attempt is not None else None
        event.foreign = not _own(allocation, event, started)


def slurm_start_time(job: JobInfo) -> datetime | None:
    """When Slurm started the job (scontrol's StartTime, the login node's local time), or None
    where it does not say (squeue's record, a job not started)."""
    try:
        started = datetime.fromisoformat(job.raw.get("StartTime", ""))
    except ValueError:  # "Unknown", "None", absent
        return None
    return started.astimezone(UTC) if started.tzinfo is None else started


def _own(
    allocation: Mapping[str, AllocationNode], event: Event, started_at: datetime | None
) -> bool:
    if started_at is not None and event.recorded_at < started_at - START_SKEW:
        return False  # before the job ran: not from its agents, whatever node it names
    if event.node is None:
        return True  # names no node: nothing to act on against anyone
    row = allocation.get(event.node)
    if row is None:
        return False
    # A node that left the allocation may be someone else's by now: only what came before.
    return row.left_at is None or event.recorded_at <= row.left_at


class _StoredReport(msgspec.Struct, frozen=True):
    """A report as ingest stored it (controller.ingest): protocol's report, beside the keys
    ingest and the judging add."""

    job_id: JobId
    nodes: tuple[AllocationMember, ...]


def stored_claim(details: object) -> tuple[str, dict[str, NodeRole]] | str:
    """The job id and {node: role} a stored report holds, or why it holds none. A row of
    another shape (an agent's `allocation` event stored before agents were refused that kind,
    a hand-edited row) is refused with the reason, never raised on."""
    try:
        report = msgspec.convert(details, _StoredReport, strict=True)
    except msgspec.ValidationError as error:
        return f"the report is malformed: {error}"
    return report.job_id, {member.node: member.role for member in report.nodes}


def _refuse(session: Session, report: Event, reason: str) -> None:
    report.foreign = True
    job = report.details.get("job_id") if isinstance(report.details, dict) else None
    record_event(
        session,
        EventKind.ALLOCATION,
        f"{REFUSED}: {reason}",
        run_id=report.run_id,
        details={"refused": reason, "report_event_id": report.id, "job_id": job},
    )


def _latest_attempt(session: Session, run_id: str) -> Attempt | None:
    return session.scalars(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number.desc()).limit(1)
    ).first()


def _adopt(
    session: Session, run: Run, attempt: Attempt | None, job: JobInfo, now: datetime
) -> Attempt:
    """The attempt the checked job is: the latest, given the job id if it had none (the
    client's attach never came); a first attempt when the run has none."""
    if attempt is None:
        attempt = Attempt(
            run_id=run.id,
            number=1,
            slurm_job_id=job.job_id,
            slurm_restarts=job.restarts,
            state=AttemptState.SUBMITTED,
            submitted_at=now,
        )
        session.add(attempt)
        session.flush()
    elif attempt.slurm_job_id is None:
        attempt.slurm_job_id = job.job_id
    return attempt


def _store(
    attempt: Attempt, members: Mapping[str, NodeRole], now: datetime, left_reason: str
) -> None:
    """The allocation becomes ``members``: new nodes join, nodes no longer in it leave (kept,
    with when and why), a node that comes back joins again."""
    rows = {row.node: row for row in attempt.nodes}
    for node, row in rows.items():
        if node not in members and row.left_at is None:
            row.left_at, row.left_reason = now, left_reason
    for node, role in members.items():
        known = rows.get(node)
        if known is None:
            attempt.nodes.append(AllocationNode(node=node, role=role, joined_at=now))
            continue
        if known.left_at is not None:
            known.joined_at, known.left_at, known.left_reason = now, None, None
        known.role = role
