"""From what Slurm and the store say to the views ``decide`` takes: the observe stage of a
control pass. ``read_slurm`` asks Slurm (one batched query for all jobs, one for all nodes),
``reconcile`` records what it says (the only writer here), ``gather`` reads the store into the
view; ``observe`` runs the three in that order. The mapping into views is pure."""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from slurmft.controller.allocation import judge_allocation_reports, judge_evidence
from slurmft.controller.detect import RankBeat, RankCompute
from slurmft.controller.intents import UNFINISHED, settle_interrupted
from slurmft.controller.pass_health import PassFailures, is_held
from slurmft.controller.reconcile import reconcile
from slurmft.controller.restarts import restart_evidence
from slurmft.controller.spec import RunSpec, SpecError
from slurmft.controller.step_window import StepWindows
from slurmft.controller.views import (
    AgentSeen,
    ClusterView,
    GpuFault,
    JobEnd,
    JobPhase,
    JobView,
    NodeCondition,
    NodeView,
    RunView,
)
from slurmft.core.budget import RestartBudget
from slurmft.core.exits import BatchExit
from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    AgentCursor,
    Attempt,
    Event,
    EventKind,
    FaultClass,
    NodeRole,
    RankHeartbeat,
    Run,
    StepTime,
)
from slurmft.db.records import OBSERVE_ONLY, denied_nodes, record_control_error
from slurmft.db.states import AttemptState, RunState
from slurmft.gpu.api import FaultAction
from slurmft.gpu.lemons import LEMON_WINDOW, SUSPECTED_CORRUPTION, XidOccurrence
from slurmft.gpu.xids import classify_fault
from slurmft.protocol import BATCH_STEP_AGENT
from slurmft.slurm.api import (
    JobInfo,
    NodeInfo,
    SlurmClient,
    SlurmError,
    SlurmJobNotFound,
    SlurmTimeout,
    SlurmUnreachable,
    silent_nodes,
)
from slurmft.slurm.commands import is_job_id
from slurmft.slurm.lost_sightings import LostSightings
from slurmft.slurm.states import JobState

log = logging.getLogger(__name__)

# Drains whose reason starts with this are slurmft's own; any other drain is someone else's.
OWN_DRAIN_PREFIX = "slurmft:"

_END_BY_STATE = {
    JobState.TIMEOUT: JobEnd.TIME_LIMIT,
    JobState.DEADLINE: JobEnd.TIME_LIMIT,
    JobState.PREEMPTED: JobEnd.PREEMPTED,
    JobState.CANCELLED: JobEnd.CANCELLED,
    JobState.NODE_FAIL: JobEnd.NODE_FAIL,
    JobState.BOOT_FAIL: JobEnd.NODE_FAIL,
}
_END_BY_EXIT: dict[int, JobEnd] = {
    BatchExit.FINISHED: JobEnd.FINISHED,
    BatchExit.GIVE_UP: JobEnd.GIVE_UP,
    # Fewer than N usable nodes and the self-requeue was refused: nodes were lost.
    BatchExit.REQUEUE: JobEnd.NODE_FAIL,
}


def node_condition(info: NodeInfo | None) -> NodeCondition:
    """A node Slurm no longer reports is as lost as a DOWN one."""
    if info is None or info.status.lost:
        return NodeCondition.LOST
    if info.status.drain_requested and not info.reason.startswith(OWN_DRAIN_PREFIX):
        return NodeCondition.DRAINED_BY_OTHERS
    return NodeCondition.OK


def batch_exit(exit_code: str) -> int | None:
    """Slurm prints ExitCode as `status:signal`; a signal means no exit status of our own."""
    status, _, signal = exit_code.partition(":")
    if not status.isdigit() or (signal and signal != "0"):
        return None
    return int(status)


def job_end(info: JobInfo) -> JobEnd:
    if info.state in _END_BY_STATE:
        return _END_BY_STATE[info.state]
    code = batch_exit(info.exit_code)
    if info.state is JobState.COMPLETED:
        return JobEnd.FINISHED
    return _END_BY_EXIT.get(code, JobEnd.FAILED) if code is not None else JobEnd.FAILED


def job_view(
    info: JobInfo,
    nodes: Mapping[str, NodeInfo],
    lost_since: Mapping[str, datetime] | None = None,
) -> JobView | None:
    """None when the state is one this Slurm table does not know: never act on it.
    ``lost_since``: since when each lost node has been seen lost (LostSightings)."""
    phase = info.state.phase
    if phase is JobPhase.UNKNOWN:
        return None
    if phase is JobPhase.WAITING:
        return JobView(info.job_id, JobPhase.WAITING)
    if phase is JobPhase.ENDED:
        return JobView(info.job_id, JobPhase.ENDED, end=job_end(info))
    host = info.batch_host or None
    # Only a RUNNING job is stuck on a dead batch host: one that is COMPLETING (requeued or
    # ending) is on its way out already, and requeueing it again fails.
    host_down = (
        info.state is JobState.RUNNING
        and host is not None
        and node_condition(nodes.get(host)) is NodeCondition.LOST
    )
    return JobView(
        info.job_id,
        JobPhase.ACTIVE,
        batch_host=host,
        batch_host_down=host_down,
        batch_host_lost_since=(lost_since or {}).get(host or "") if host_down else None,
        silent_nodes=frozenset(silent_nodes(info.nodes, nodes)),
    )


@dataclass(frozen=True)
class StepSample:
    rank: int
    node: str
    peer_group: str
    ended_at: datetime
    compute_s: float


def rank_compute(
    samples: Iterable[StepSample], *, now: datetime, bucket: timedelta, buckets: int
) -> tuple[RankCompute, ...]:
    """Per-rank median compute time in each of the last ``buckets`` buckets (oldest first).

    A rank missing from any bucket is left out: it is restarting or gone, and its empty bucket
    must not read as fast or slow."""
    start = now - bucket * buckets
    per_rank: dict[int, list[list[float]]] = defaultdict(lambda: [[] for _ in range(buckets)])
    identity: dict[int, tuple[str, str]] = {}
    for s in samples:
        index = int((s.ended_at - start) / bucket)
        if 0 <= index < buckets:
            per_rank[s.rank][index].append(s.compute_s)
            identity[s.rank] = (s.node, s.peer_group)
    return tuple(
        RankCompute(
            rank,
            identity[rank][0],
            tuple(statistics.median(b) for b in values),
            peer_group=identity[rank][1],
        )
        for rank, values in sorted(per_rank.items())
        if all(values)
    )


# --- gathering: the only I/O of observe -------------------------------------------------------

# A keyed action that failed (sbatch refused a resubmission, a requeue hit a Slurm hiccup) is
# decided again once it is this old, so a transient failure is retried and never strands a run.
RETRY_FAILED_AFTER = timedelta(seconds=60)
LIVE_RUN_STATES = (RunState.PENDING, RunState.RUNNING, RunState.RECOVERING)
FINDING_KINDS = (
    EventKind.NODE_LOST,
    EventKind.GPU_FAULT,
    EventKind.HANG,
    EventKind.STRAGGLER,
    EventKind.BATCH_HOST_DOWN,
    EventKind.CHANNEL_SILENT,
    EventKind.TIME_LIMIT,
    EventKind.PREEMPTED,
    EventKind.CONTROL_ERROR,  # decide's own, keyed: recorded once per attempt
)


@dataclass(frozen=True)
class SlurmSnapshot:
    """The tracked runs with their latest attempts, and what Slurm says of their jobs and of
    every node: two batched queries (and the details of the jobs that need them)."""

    runs: tuple[Run, ...]
    attempts: Mapping[str, Attempt | None]  # each run's latest attempt, by run id
    jobs: Mapping[str, JobInfo]
    nodes: Mapping[str, NodeInfo]
    # Runs whose job could not be read (a stored job id that is not one, a record Slurm could
    # not give): the error, by run id. Such a run's job is left out of ``jobs`` this pass.
    errors: Mapping[str, str] = field(default_factory=dict)


def observe(
    session: Session,
    slurm: SlurmClient,
    *,
    now: datetime,
    bucket: timedelta = timedelta(minutes=1),
    buckets: int = 5,
    steps: StepWindows | None = None,
    lost: LostSightings | None = None,
    failures: PassFailures | None = None,
) -> ClusterView:
    """The observe stage of a control pass: ask Slurm (`read_slurm`), record what it says about
    the tracked jobs (`reconcile`, the one writer), then read everything ``decide`` needs
    (`gather`). Slurm unreachable: nothing recorded, a view that decides nothing. ``lost``
    (the daemon's, kept between passes) says since when each lost node has been lost.
    ``failures`` collects the runs whose part failed (controller.pass_health); a held run's
    part is not tried: its view carries only what its owner's cancel needs."""
    failures = PassFailures() if failures is None else failures
    try:
        settle_interrupted(session, slurm)  # before the attempts are read: it may open one
    except (SlurmUnreachable, SlurmTimeout):
        return ClusterView(now=now, slurm_reachable=False)
    snapshot = read_slurm(session, slurm)
    if snapshot is None:
        return ClusterView(now=now, slurm_reachable=False)
    for run_id, error in snapshot.errors.items():
        log.warning("run %s: %s", run_id, error, extra={"run_id": run_id})
        record_control_error(session, run_id, "reading its job from Slurm", error)
        failures.add(run_id, "reading its job from Slurm", error)
    tried = [run for run in snapshot.runs if not is_held(run)]
    tracked = {run.id: (run, snapshot.attempts[run.id]) for run in tried}
    reconcile(session, tracked, snapshot.jobs, now=now, failures=failures)
    # The batch steps' reports checked against Slurm, then the evidence against them: only the
    # run's own (foreign false) is gathered below.
    judge_allocation_reports(session, slurm, now=now, failures=failures)
    judge_evidence(session, [run.id for run in tried], failures=failures)
    lost_since = lost.update(snapshot.nodes, now) if lost is not None else {}
    return gather(
        session, snapshot, now=now, bucket=bucket, buckets=buckets, steps=steps,
        lost_since=lost_since, failures=failures,
    )  # fmt: skip


def read_slurm(session: Session, slurm: SlurmClient) -> SlurmSnapshot | None:
    """The live runs and Slurm's view of their jobs and of the nodes; None when Slurm does not
    answer (nothing is decided on stale information)."""
    runs = tuple(session.scalars(select(Run).where(Run.state.in_(LIVE_RUN_STATES))).all())
    attempts = {run.id: _latest_attempt(session, run.id) for run in runs}
    errors: dict[str, str] = {}
    by_job: dict[str, Attempt] = {}
    for run_id, attempt in attempts.items():
        if attempt is None or not attempt.slurm_job_id:
            continue
        if is_job_id(attempt.slurm_job_id):
            by_job[attempt.slurm_job_id] = attempt
        else:  # one run's bad job id must not fail the batched query for everyone
            errors[run_id] = f"not a Slurm job id: {attempt.slurm_job_id!r}; its job is not read"
    job_ids = sorted(by_job)
    try:
        jobs = slurm.jobs(job_ids)
        nodes = slurm.nodes()  # every node: one call, and the partition's size for the caps
        details, failed = _details(
            slurm,
            [j for j in job_ids if j not in jobs or _needs_details(jobs[j], by_job[j])],
        )
    except (SlurmUnreachable, SlurmTimeout):
        return None
    jobs |= details
    for job_id, error in failed.items():
        jobs.pop(job_id, None)  # judged on half a record, it could look ended
        errors[by_job[job_id].run_id] = error
    return SlurmSnapshot(runs, attempts, jobs, nodes, errors)


def gather(
    session: Session,
    snapshot: SlurmSnapshot,
    *,
    now: datetime,
    bucket: timedelta = timedelta(minutes=1),
    buckets: int = 5,
    steps: StepWindows | None = None,
    lost_since: Mapping[str, datetime] | None = None,
    failures: PassFailures | None = None,
) -> ClusterView:
    """Everything ``decide`` needs, from the store and Slurm's snapshot. Reads only.

    With ``steps`` (the daemon's, kept between passes) the straggler window's step times are
    read incrementally; without it, whole."""
    runs = snapshot.runs
    if steps is not None:
        steps.keep_only({run.id for run in runs})  # an ended run's window is forgotten
    attempts = {run.id: _latest_attempt(session, run.id) for run in runs}  # requeues add one
    views = []
    for run in runs:
        if is_held(run):
            views.append(_held_view(run, attempts[run.id], snapshot))
            continue
        try:
            views.append(
                _run_view(
                    session,
                    run,
                    attempts[run.id],
                    snapshot.jobs,
                    snapshot.nodes,
                    now=now,
                    bucket=bucket,
                    buckets=buckets,
                    steps=steps,
                    lost_since=lost_since or {},
                )
            )
        except SQLAlchemyError:
            raise  # the store's failure, not this run's: the pass is skipped for everyone
        except Exception as exc:
            # This run's data could not be read into a view (the only write gather makes):
            # nothing is decided for it this pass, and the other runs go on.
            (failures or PassFailures()).record(session, run.id, "observing it", exc)
    nodes = snapshot.nodes
    return ClusterView(
        now=now,
        slurm_reachable=True,
        runs=tuple(views),
        denylist=denied_nodes(session, now=now),
        drains_last_hour=_drains_since(session, now - timedelta(hours=1)),
        partition_nodes=len(nodes),
        drained_nodes=sum(
            1
            for n in nodes.values()
            if n.status.drain_requested and n.reason.startswith(OWN_DRAIN_PREFIX)
        ),
        straggler_windows=_straggler_windows(session),
        xid_history=xid_history(session, now=now),
    )


def _needs_details(job: JobInfo, attempt: Attempt) -> bool:
    """squeue has no exit code and no restart count. A requeued job may go from RUNNING through
    COMPLETING to RUNNING again (measured: 3 s) without ever being seen PENDING, so a
    COMPLETING job, or one running with another batch host than its attempt recorded, is read
    in detail too: scontrol's Restarts tells a requeue from an ending."""
    if job.state.is_ended or job.state is JobState.COMPLETING:
        return True
    return bool(attempt.batch_host and job.batch_host and job.batch_host != attempt.batch_host)


def _details(slurm: SlurmClient, job_ids: list[str]) -> tuple[dict[str, JobInfo], dict[str, str]]:
    """Jobs in detail (scontrol): a job purged from slurmctld is reported as failed without an
    exit status. Slurm down ends the pass (raised); any other error reading one job is that
    job's alone: the errors, by job id, come second."""
    details = {}
    failed = {}
    for job_id in job_ids:
        try:
            details[job_id] = slurm.job(job_id)
        except SlurmJobNotFound:
            details[job_id] = JobInfo(job_id, JobState.FAILED, reason="purged from slurmctld")
        except (SlurmUnreachable, SlurmTimeout):
            raise
        except SlurmError as exc:
            failed[job_id] = f"scontrol could not read job {job_id}: {exc}"
    return details, failed


def _latest_attempt(session: Session, run_id: str) -> Attempt | None:
    return session.scalars(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number.desc()).limit(1)
    ).first()


def _run_view(
    session: Session,
    run: Run,
    attempt: Attempt | None,
    jobs: Mapping[str, JobInfo],
    nodes: Mapping[str, NodeInfo],
    *,
    now: datetime,
    bucket: timedelta,
    buckets: int,
    steps: StepWindows | None = None,
    lost_since: Mapping[str, datetime],
) -> RunView:
    info = jobs.get(attempt.slurm_job_id) if attempt and attempt.slurm_job_id else None
    job = job_view(info, nodes, lost_since) if info else None
    since = attempt.submitted_at if attempt else run.created_at
    placed_since = _placed_since(session, run.id, since)
    window_since = max(now - bucket * buckets, placed_since)
    if steps is None:
        compute = rank_compute(
            _step_samples(session, run.id, window_since), now=now, bucket=bucket, buckets=buckets
        )
    else:
        compute = steps.rank_compute(
            session, run.id, since=window_since, now=now, bucket=bucket, buckets=buckets
        )
    return RunView(
        run_id=run.id,
        nodes_needed=run.nodes,
        job=job,
        nodes=(
            _lost_by_requeue(session, attempt, nodes)
            if job is not None and job.phase is JobPhase.WAITING
            else _node_views(session, attempt, info, nodes, lost_since)
        ),
        beats=_beats(session, run.id, attempt, placed_since),
        compute=compute,
        gpu_faults=_gpu_faults(session, run.id, since),
        numerical_stop=_numerical_stop(session, run.id, since),
        agents=_agents_seen(session, run.id, since),
        excluded=denied_nodes(session, run_id=run.id, now=now),
        steps_ask_gres=_steps_ask_gres(run),
        budget=RestartBudget(restarts_without_progress=run.restarts_without_progress),
        restarts=None if run.state.is_terminal else restart_evidence(session, run),
        cancel_requested=run.cancel_requested_at is not None,
        reported=_reported_keys(session, run.id, since, now=now),
    )


def _held_view(run: Run, attempt: Attempt | None, snapshot: SlurmSnapshot) -> RunView:
    """A held run (controller.pass_health): none of its stored evidence is read, only what
    its owner's cancel needs (decide acts on nothing else for it)."""
    info = snapshot.jobs.get(attempt.slurm_job_id) if attempt and attempt.slurm_job_id else None
    return RunView(
        run_id=run.id,
        nodes_needed=run.nodes,
        job=job_view(info, snapshot.nodes) if info else None,
        cancel_requested=run.cancel_requested_at is not None,
        held=True,
    )


def _steps_ask_gres(run: Run) -> bool:
    """The run's agent steps ask for GRES, by its stored spec. One this version cannot read
    counts as asking: all that costs is a silent node set DOWN before a requeue."""
    try:
        return bool(RunSpec.from_dict(dict(run.spec)).step_gres)
    except SpecError:
        return True


def _node_views(
    session: Session,
    attempt: Attempt | None,
    info: JobInfo | None,
    nodes: Mapping[str, NodeInfo],
    lost_since: Mapping[str, datetime] | None = None,
) -> tuple[NodeView, ...]:
    # The allocation's nodes (the batch step's report, checked against Slurm) give the roles;
    # one that left it is no longer the run's.
    roles = {n.node: n.role for n in attempt.nodes if n.left_at is None} if attempt else {}
    # The nodes Slurm gave the attempt, as first seen running: a node the job lost while the
    # daemon was down (or between recording the loss and acting on it) is no longer held, and
    # only this list still names it.
    # Only a RUNNING job's missing node was taken away: a COMPLETING one (cancelled, preempted,
    # requeued, finished) gives its nodes back one by one as they finish (seen in the suite: a
    # preempted job's freed nodes read as lost, and the ending job was requeued without them).
    running = info is not None and info.state is JobState.RUNNING
    started_with = (
        set(attempt.nodelist.split(",")) if running and attempt and attempt.nodelist else set()
    )
    if running:
        started_with |= set(roles)
    held = set(info.nodes) if info and info.state.holds_nodes else set()
    views = []
    for name in sorted(held | started_with):
        # A node the job no longer holds was taken away from it (shrunk under --no-kill).
        condition = node_condition(nodes.get(name)) if name in held else NodeCondition.LOST
        # Since when, for a lost node the job still holds: Slurm's word, to be confirmed.
        since = (lost_since or {}).get(name) if name in held else None
        views.append(NodeView(name, roles.get(name, NodeRole.ACTIVE), condition, since))
    return tuple(views)


def _lost_by_requeue(
    session: Session, attempt: Attempt | None, nodes: Mapping[str, NodeInfo]
) -> tuple[NodeView, ...]:
    """A waiting job's nodes: those its requeued attempt held that Slurm calls lost. The batch
    step requeues the job itself as soon as too few nodes are left, and the job may be queued
    again before any pass saw the node lost in the running job; this pass still records it."""
    if attempt is None or attempt.state is not AttemptState.SUBMITTED or attempt.number < 2:
        return ()
    requeued = session.scalars(
        select(Attempt).where(
            Attempt.run_id == attempt.run_id, Attempt.number == attempt.number - 1
        )
    ).first()
    if requeued is None or requeued.state is not AttemptState.REQUEUED or not requeued.nodelist:
        return ()
    held = requeued.nodelist.split(",")
    return tuple(
        NodeView(name, NodeRole.ACTIVE, NodeCondition.LOST)
        for name in held
        if node_condition(nodes.get(name)) is NodeCondition.LOST
    )


def _beats(
    session: Session, run_id: str, attempt: Attempt | None, placed_since: datetime
) -> tuple[RankBeat, ...]:
    """The latest heartbeat of each rank since the ranks were last placed: a rank's row from
    before a restart is its old worker's, and its silence while the restarted peers report
    already is no hang (the rank may even live on another node now)."""
    latest = RankHeartbeat.__table__.c  # plain rows: one per rank, thousands in a large run
    query = select(
        latest.rank,
        latest.node,
        latest.phase,
        latest.step,
        latest.received_at,
        latest.progress_age_s,
        latest.deadline_s,
    ).where(latest.run_id == run_id, latest.received_at >= placed_since)
    if attempt is not None:
        query = query.where(latest.attempt_id == attempt.id)
    return tuple(
        RankBeat(*row[:6], float("inf") if row[6] is None else row[6])
        for row in session.execute(query)
    )


def _step_samples(session: Session, run_id: str, since: datetime) -> list[StepSample]:
    rows = session.execute(
        select(
            StepTime.rank,
            StepTime.peer_group,
            StepTime.ended_at,
            StepTime.compute_s,
            RankHeartbeat.node,
        )
        .join(
            RankHeartbeat,
            (RankHeartbeat.run_id == StepTime.run_id) & (RankHeartbeat.rank == StepTime.rank),
        )
        .where(StepTime.run_id == run_id, StepTime.ended_at >= since)
    ).all()
    return [
        StepSample(rank, node, group, ended, compute) for rank, group, ended, compute, node in rows
    ]


def _placed_since(session: Session, run_id: str, since: datetime) -> datetime:
    """When the run's ranks last moved between nodes: a node left it, or workers restarted
    (a spare joining restarts everyone) or are about to (a rank saw a peer fail: every worker
    restarts, and the ranks exit one by one, so one quiet while another still beats is no
    hang). Step times carry a rank, not a node, and a rank is mapped to the node that holds
    it now; compute times from before a move would be charged to the rank's new node (the old
    straggler's slowness to the spare), so only later ones count, and the window must fill
    again before anyone is judged."""
    moved = [
        session.scalar(
            select(func.max(Event.occurred_at)).where(
                Event.run_id == run_id,
                Event.kind.in_((EventKind.RESTART, EventKind.COLLECTIVE_ERROR)),
            )
        ),
        session.scalar(
            select(func.max(Action.created_at)).where(
                Action.run_id == run_id, Action.kind == ActionKind.AGENT_LEAVE
            )
        ),
    ]
    return max([since, *(m for m in moved if m is not None)])


def _agents_seen(session: Session, run_id: str, since: datetime) -> tuple[AgentSeen, ...]:
    """Each node's newest agent report in this attempt (an agent step relaunched on a node
    starts a new agent there: the newest counts)."""
    rows = session.execute(
        select(AgentCursor.node, func.max(AgentCursor.updated_at))
        .where(
            AgentCursor.run_id == run_id,
            AgentCursor.updated_at >= since,
            # The batch step reports too, from node 0: its batches say nothing of that agent.
            ~AgentCursor.agent_id.startswith(BATCH_STEP_AGENT, autoescape=True),
        )
        .group_by(AgentCursor.node)
    ).all()
    return tuple(AgentSeen(node, at) for node, at in rows)


def _reported_keys(
    session: Session, run_id: str, since: datetime, *, now: datetime
) -> frozenset[str]:
    """Findings already recorded (events) or acted on (actions) for this attempt; an action
    that failed counts for RETRY_FAILED_AFTER, then it is decided (and tried) again. One a
    stopped daemon left unfinished (slurmft.controller.intents) never counts: it is decided
    again at once, as if the daemon had not stopped."""
    details = session.scalars(
        select(Event.details).where(
            Event.run_id == run_id,
            Event.kind.in_(FINDING_KINDS),
            Event.source != "agent",  # the daemon's own findings: an agent's word is no key
            Event.recorded_at >= since,
        )
    ).all()
    evidence = session.scalars(
        select(Action.evidence).where(
            Action.run_id == run_id,
            Action.created_at >= since,
            (Action.status != ActionStatus.FAILED)
            | (
                (Action.created_at >= now - RETRY_FAILED_AFTER)
                & func.coalesce(Action.error, "").not_in(UNFINISHED)
            ),
        )
    ).all()
    return frozenset(
        d["key"] for d in [*details, *evidence] if isinstance(d, dict) and d.get("key")
    )


def _gpu_faults(session: Session, run_id: str, since: datetime) -> tuple[GpuFault, ...]:
    """GPU faults the run's agents reported (each already an event row) about the run's own
    nodes: foreign evidence, and evidence held until the allocation is known, are not read."""
    events = session.scalars(
        select(Event)
        .where(
            Event.run_id == run_id,
            Event.kind == EventKind.GPU_FAULT,
            Event.source == "agent",
            Event.foreign.is_(False),
            Event.recorded_at >= since,
        )
        .order_by(Event.id)
    ).all()
    return tuple(
        GpuFault(
            event.node,
            fault_action(event.details, event.xid),
            event.message,
            xid=event.xid,
            gpu=event.gpu_index,
            event_id=event.id,
        )
        for event in events
        if event.node
    )


def _numerical_stop(session: Session, run_id: str, since: datetime) -> str | None:
    """The words of this attempt's first numerical fault whose policy stops the run: its
    workers reproduced a non-finite loss and exited (slurmft.train.numerical); None if none."""
    events = session.scalars(
        select(Event)
        .where(
            Event.run_id == run_id,
            Event.kind == EventKind.NUMERICAL_FAULT,
            Event.source == "agent",
            Event.recorded_at >= since,
        )
        .order_by(Event.id)
    ).all()
    stops = (e for e in events if isinstance(e.details, dict) and e.details.get("action") == "stop")
    first = next(stops, None)
    return None if first is None else first.message


def fault_action(details: dict[str, object], xid: int | None) -> FaultAction:
    """The daemon's own classification of an agent's report, from the fault's kind and code
    through the one table (slurmft.gpu.xids.classify_fault); the agent's stated action is kept
    in the record but never read. An unknown fault is a restart, never a crash or a drain."""
    detail = details.get("detail")
    return classify_fault(
        str(details.get("fault_kind") or ""),
        xid=xid,
        code=details.get("code"),
        message=detail if isinstance(detail, str) else "",
    )


def xid_history(session: Session, *, now: datetime) -> tuple[XidOccurrence, ...]:
    """Every run's Xids of the lemon window, and its numerical faults that a re-run did not
    reproduce (SUSPECTED_CORRUPTION): the evidence decide judges lemons on."""
    rows = session.execute(
        select(Event.node, Event.run_id, Event.xid, Event.occurred_at).where(
            Event.kind == EventKind.GPU_FAULT,
            Event.foreign.is_(False),  # another run's word on a node it never held: not counted
            Event.xid.is_not(None),
            Event.node.is_not(None),
            Event.run_id.is_not(None),
            Event.occurred_at >= now - LEMON_WINDOW,
        )
    ).all()
    suspected = session.execute(
        select(Event.node, Event.run_id, Event.occurred_at).where(
            Event.kind == EventKind.NUMERICAL_FAULT,
            Event.fault_class == FaultClass.HARDWARE,
            Event.node.is_not(None),
            Event.run_id.is_not(None),
            Event.occurred_at >= now - LEMON_WINDOW,
        )
    ).all()
    known = cast("Iterable[tuple[str, str, int, datetime]]", rows)  # none NULL: the WHERE above
    corrupt = cast("Iterable[tuple[str, str, datetime]]", suspected)
    return (
        *(XidOccurrence(node, run_id, xid, at) for node, run_id, xid, at in known),
        *(XidOccurrence(node, run_id, SUSPECTED_CORRUPTION, at) for node, run_id, at in corrupt),
    )


def _drains_since(session: Session, since: datetime) -> int:
    """The drains attempted since then: planned, done, refused (not permitted) or failed. A
    refused or failed one counts too: otherwise a daemon without operator rights, or a drain
    Slurm rejects, would try the hourly limit's worth again on every pass. Only observe-only's
    records (decided, never tried) are left out."""
    return (
        session.scalar(
            select(func.count())
            .select_from(Action)
            .where(
                Action.kind == ActionKind.DRAIN_NODE,
                Action.created_at >= since,
                (Action.status != ActionStatus.SKIPPED)
                | (Action.error.is_(None))
                | (Action.error != OBSERVE_ONLY),
            )
        )
        or 0
    )


def _straggler_windows(session: Session) -> dict[str, int]:
    """The daemon's own straggler findings per node. A run's in-process detector reports too
    (source "agent"), but through rank 0's agent, so such an event names rank 0's node, not the
    slow one: it is evidence for the run's report, never a window against a node."""
    rows = session.execute(
        select(Event.node, func.count())
        .where(
            Event.kind == EventKind.STRAGGLER,
            Event.node.is_not(None),
            Event.source != "agent",
            Event.foreign.is_not(True),
        )
        .group_by(Event.node)
    ).all()
    return {node: count for node, count in cast("Iterable[tuple[str, int]]", rows)}  # no NULL node
