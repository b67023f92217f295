"""The controller's policy: observations in, actions out. Pure: no clock, no I/O.

The recovery ladder (docs/design.md): workers restart in place (torchrun does it) → a spare replaces
a lost or excluded node in the same allocation → the batch step relaunches on the healthy nodes
→ the job is requeued without the bad nodes → a new job is submitted when the old one cannot be
requeued → a crash loop stops. This module decides the steps that need the cluster view; the
batch step and the agents do the in-allocation ones on their own.

Trust: evidence from a run's own processes takes a node out of *that run* at once; draining it
in Slurm for everyone follows the trust policy (GPU drain-class faults by default, stragglers
only after repeated windows, lemons only across different runs) and the drain rate limits.
Evidence acts only on the run's own nodes (`RunView.nodes`: Slurm's view of its job and its
allocation): observe gathers only evidence judged the run's own, and decide checks again, so a
node outside the allocation is never excluded, drained or evicted on a run's word.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Required, TypedDict, Unpack

from slurmft.config import Config, PolicySection, TrustSection
from slurmft.controller.detect import find_hangs, find_stragglers, find_unresponsive
from slurmft.controller.views import (
    Action,
    ClusterView,
    DrainNode,
    EvictNode,
    ExcludeFromJob,
    ExcludeNode,
    FinishRun,
    JobEnd,
    JobPhase,
    JobView,
    NodeCondition,
    NotifyHuman,
    RecordEvent,
    RecordRestarts,
    RequeueJob,
    RestartEvidence,
    RestartWorkers,
    RunView,
    SubmitAttempt,
)
from slurmft.core.budget import (
    CAUSE_WINDOW_S,
    Restart,
    RestartBudget,
    Seen,
    Sighting,
    budget_from_history,
    charged_restarts,
    spent_at,
)
from slurmft.core.kinds import EventKind, FaultClass, NodeRole
from slurmft.core.states import RunState
from slurmft.gpu.api import FaultAction
from slurmft.gpu.lemons import judge_lemons


@dataclass(frozen=True)
class TrustPolicy:
    # The defaults are the [trust] section's (slurmft.config): written there only.
    drain_gpu_faults: bool = TrustSection.drain_gpu_faults
    straggler_drain_after_windows: int = TrustSection.straggler_drain_after_windows
    drains_per_hour: int = TrustSection.drains_per_hour
    # Of the partition; at least one drain is always allowed.
    max_drained_fraction: float = TrustSection.max_drained_fraction
    # Different runs with restart-class Xids on a node make it a lemon.
    lemon_min_runs: int = TrustSection.lemon_min_runs


# A straggler window is judged in this many equal buckets; slow in every one of them is what
# "sustained" means (one noisy stretch never flags anyone), whatever the window's length.
STRAGGLER_WINDOW_BUCKETS = 5


@dataclass(frozen=True)
class Policy:
    # The defaults are the [policy] section's (slurmft.config): written there only.
    straggler_threshold: float = PolicySection.straggler_threshold
    straggler_window_s: float = PolicySection.straggler_window_s
    straggler_window_buckets: int = STRAGGLER_WINDOW_BUCKETS
    silent_after_s: float = PolicySection.silent_after_s
    unresponsive_after_s: float = PolicySection.unresponsive_after_s
    confirm_s: float = PolicySection.confirm_s
    max_restarts_without_progress: int = PolicySection.max_restarts_without_progress
    trust: TrustPolicy = TrustPolicy()

    @property
    def straggler_bucket(self) -> timedelta:
        """The length of one bucket of compute time (observe buckets the step times by it)."""
        return timedelta(seconds=self.straggler_window_s / self.straggler_window_buckets)

    @classmethod
    def from_config(cls, config: Config) -> Policy:
        policy, trust = config.settings.policy, config.settings.trust
        return cls(
            straggler_threshold=policy.straggler_threshold,
            straggler_window_s=policy.straggler_window_s,
            silent_after_s=policy.silent_after_s,
            unresponsive_after_s=policy.unresponsive_after_s,
            confirm_s=policy.confirm_s,
            max_restarts_without_progress=policy.max_restarts_without_progress,
            trust=TrustPolicy(
                drain_gpu_faults=trust.drain_gpu_faults,
                straggler_drain_after_windows=trust.straggler_drain_after_windows,
                drains_per_hour=trust.drains_per_hour,
                max_drained_fraction=trust.max_drained_fraction,
                lemon_min_runs=trust.lemon_min_runs,
            ),
        )


class _DrainGate:
    """Drain rate limits across one decision pass."""

    def __init__(self, trust: TrustPolicy, view: ClusterView) -> None:
        fraction_cap = int(trust.max_drained_fraction * view.partition_nodes)
        self._left = min(
            trust.drains_per_hour - view.drains_last_hour,
            max(1, fraction_cap) - view.drained_nodes,
        )
        self._drained: set[str] = set()

    def drain(
        self, node: str, run_id: str, reason: str, evidence: dict[str, Any] | None = None
    ) -> list[Action]:
        if node in self._drained:
            return []
        if self._left <= 0:
            return [
                NotifyHuman(
                    run_id, f"drain of {node} refused by the rate limits: {reason}", evidence or {}
                )
            ]
        self._left -= 1
        self._drained.add(node)
        return [DrainNode(run_id, reason, evidence or {}, node=node)]


@dataclass(frozen=True)
class Decision:
    """What decide returns to the daemon: the actions, and the runs whose deciding failed
    (run id -> the error), which count towards holding them (controller.pass_health)."""

    actions: list[Action]
    failed: Mapping[str, str]


def decide(view: ClusterView, policy: Policy) -> list[Action]:
    """Every action the controller should take now, in order."""
    return decide_runs(view, policy).actions


def decide_runs(view: ClusterView, policy: Policy) -> Decision:
    """`decide`, with the runs whose deciding failed."""
    if not view.slurm_reachable:
        return Decision([], {})  # never act on stale information
    gate = _DrainGate(policy.trust, view)
    lemons = lemon_nodes(view, policy.trust)
    actions: list[Action] = []
    failed: dict[str, str] = {}
    for run in view.runs:
        if run.held:
            actions += _decide_held(run)
            continue
        try:
            # A restart this pass's own node removal caused is free now, not a pass later.
            removing = view.now if _nodes_leaving(run, view, policy, lemons) else None
            cap = policy.max_restarts_without_progress
            budget, counted = count_restarts(run, cap, removing_at=removing)
            spent = _spent_at(run, cap, removing) if budget.exhausted else None
            counted_run = replace(run, budget=budget, budget_spent_at=spent)
            decided = counted + _decide_run(counted_run, view, policy, gate, lemons)
        except Exception as exc:  # one run's bad data must not stop the others
            decided = _undecided(run, exc)
            failed[run.run_id] = f"{type(exc).__name__}: {exc}"
        actions += decided
    return Decision(actions, failed)


def _decide_held(run: RunView) -> list[Action]:
    """A held run: only its owner's cancel is carried out (its job cancelled, the run ended)."""
    if not run.cancel_requested:
        return []
    job = run.job
    running = job is not None and job.phase is not JobPhase.ENDED
    return [
        FinishRun(
            run.run_id,
            "cancelled by its owner (the run was held)",
            state=RunState.CANCELLED,
            job_id=job.job_id if running and job is not None else None,
        )
    ]


def _undecided(run: RunView, exc: Exception) -> list[Action]:
    """Deciding for this run failed (its data, or a bug): nothing is done for it this pass,
    and the error is recorded on it, once per attempt; the other runs are decided as usual."""
    error = f"{type(exc).__name__}: {exc}"
    return _event(
        run,
        f"decide-error:{type(exc).__name__}",  # not the message: it may differ every pass
        reason=f"control pass: deciding failed: {error}",
        kind=EventKind.CONTROL_ERROR,
        fault_class=FaultClass.INFRASTRUCTURE,
    )


def count_restarts(
    run: RunView, cap: int, *, removing_at: datetime | None = None
) -> tuple[RestartBudget, list[Action]]:
    """The run's budget: its restarts in a row since its newest checkpoint first appeared
    (slurmft.core.budget's rule over `RunView.restarts`), and the bookkeeping to record: the
    count, the progress it counts from, and the restarts whose daemon event is missing or
    names another cause. (The job that failed just now is `_job_ended`'s to charge.)
    ``removing_at``: this pass takes a node out of the run (`_nodes_leaving`), a cause the
    store does not hold yet."""
    evidence = run.restarts
    if evidence is None:  # an ended run: its count stays as it was
        return replace(run.budget, max_restarts_without_progress=cap), []
    counted, causes = _budget_sightings(evidence, removing_at)
    budget = budget_from_history(counted, cap)
    restarts = charged_restarts([*evidence.restarts, *causes])
    progress = evidence.progress
    changed = tuple(
        r for r in restarts if evidence.recorded.get(r.key) != (r.cause, r.node_removed)
    )
    progress_at = progress.at if progress else evidence.progress_at
    same_count = budget.restarts_without_progress == run.budget.restarts_without_progress
    if not changed and same_count and progress_at == evidence.progress_at:
        return budget, []
    return budget, [
        RecordRestarts(
            run.run_id,
            f"{budget.restarts_without_progress} restarts in a row without progress (cap {cap})",
            restarts_without_progress=budget.restarts_without_progress,
            last_progress_at=progress_at,
            restarts=changed,
            progress_only=not changed and same_count,
        )
    ]


def _budget_sightings(
    evidence: RestartEvidence, removing_at: datetime | None
) -> tuple[list[Sighting], list[Sighting]]:
    """What the budget is counted from (the newest progress, the restarts since, their causes
    from a cause window before), and every cause known, this pass's removal among them."""
    progress = evidence.progress
    since = progress.at if progress else evidence.since
    window = timedelta(seconds=CAUSE_WINDOW_S)
    causes = [
        *evidence.causes,
        *([Sighting(Seen.NODE_REMOVED, removing_at)] if removing_at is not None else []),
    ]
    counted = [
        *([progress] if progress else []),
        *(s for s in evidence.restarts if s.at >= since),
        *(c for c in causes if c.at >= since - window),
    ]
    return counted, causes


def _spent_at(run: RunView, cap: int, removing_at: datetime | None) -> datetime | None:
    """When the run's budget, counted as `count_restarts` does, was first spent."""
    if run.restarts is None:
        return None
    return spent_at(_budget_sightings(run.restarts, removing_at)[0], cap)


def lemon_nodes(view: ClusterView, trust: TrustPolicy) -> frozenset[str]:
    """Nodes whose restart-class Xids repeat across different runs (slurmft.gpu.lemons)."""
    verdicts = judge_lemons(view.xid_history, now=view.now, min_runs=trust.lemon_min_runs)
    return frozenset(node for node, verdict in verdicts.items() if verdict.is_lemon)


def _decide_run(
    run: RunView, view: ClusterView, policy: Policy, gate: _DrainGate, lemons: frozenset[str]
) -> list[Action]:
    job = run.job
    if run.cancel_requested and (job is None or job.phase is not JobPhase.ENDED):
        return [
            FinishRun(
                run.run_id,
                "cancelled by its owner",
                state=RunState.CANCELLED,
                job_id=job.job_id if job else None,
            )
        ]
    if job is None:
        return []
    if run.numerical_stop is not None:  # the script's own policy: restarting would meet it again
        running = job.phase is not JobPhase.ENDED
        return _stop(run, run.numerical_stop, job_id=job.job_id if running else None)
    if job.phase is JobPhase.WAITING:
        # Waiting: nothing to recover; a node lost as the job was requeued is still recorded.
        return _lost_nodes(run, view, policy, gate)[0] + _keep_excluded(run, job, view)
    if job.phase is JobPhase.ENDED:
        return _job_ended(run, job, view)
    if run.budget.exhausted and not _cause_in_doubt(run, job, view, policy):
        return _stop(run, run.budget.stop_reason(), job_id=job.job_id)
    if _batch_host_lost(run, job, view, policy):
        return _batch_host_down(run, job, view, policy)
    actions: list[Action] = []
    removed: set[str] = set()
    for finder in _removal_finders(lemons):
        found, gone = finder(run, view, policy, gate)
        actions += found
        removed |= gone
    actions += _hangs(run, view, policy, removed)
    found, gone = _stragglers(run, view, policy, gate, removed)
    actions += found
    removed |= gone
    actions += _capacity(run, job, view, policy, removed)
    return actions


_Finder = Callable[[RunView, ClusterView, Policy, _DrainGate], tuple[list[Action], set[str]]]


def _removal_finders(lemons: frozenset[str]) -> tuple[_Finder, ...]:
    """What takes a node out of a running job's run: Slurm's word that it is lost (or drained
    by someone else), a GPU fault that drains it, an agent gone silent."""
    return (_lost_nodes, partial(_gpu_faults, lemons=lemons), _unresponsive_nodes)


def _cause_in_doubt(run: RunView, job: JobView, view: ClusterView, policy: Policy) -> bool:
    """The restart that spent the run's budget may still turn out to have a node loss as its
    cause, which would make it free: the crash-loop stop waits (a run at the cap whose node
    dies must not be stopped as a crash loop in the seconds before the loss is known). In
    doubt: that restart was first reported less than ``policy.confirm_s`` ago (a dead node's
    agent is not silent for long yet, Slurm has not called it lost yet; counted from the
    restart that spent the budget, not the newest, so a fast crash loop is stopped all the
    same); one of the run's nodes Slurm calls lost, unconfirmed; an agent of the run silent for
    ``confirm_s`` but not yet for ``unresponsive_after_s`` (past that its node leaves the run,
    `_unresponsive_nodes`). A true crash loop is stopped one ``confirm_s`` later."""
    spent = run.budget_spent_at
    if spent is not None and (view.now - spent).total_seconds() < policy.confirm_s:
        return True
    if job.batch_host_down and job.batch_host and not _batch_host_lost(run, job, view, policy):
        return True
    for node in run.nodes:
        lost = node.condition is NodeCondition.LOST
        if (
            lost
            and node.name not in run.excluded
            and not _confirmed(run, node.name, node.lost_since, view, policy)
        ):
            return True
    return any(
        agent.node not in run.excluded
        and policy.confirm_s
        <= (view.now - view.heard(agent.last_report_at)).total_seconds()
        < policy.unresponsive_after_s
        for agent in run.agents
    )


def _batch_host_lost(run: RunView, job: JobView, view: ClusterView, policy: Policy) -> bool:
    """Slurm's confirmed word that the job's batch host is lost: the job is requeued."""
    return bool(
        job.batch_host_down
        and job.batch_host
        and _confirmed(run, job.batch_host, job.batch_host_lost_since, view, policy)
    )


def _nodes_leaving(
    run: RunView, view: ClusterView, policy: Policy, lemons: frozenset[str]
) -> set[str]:
    """The nodes `_decide_run` takes out of the run this pass, for the restart count: the loss
    that caused a restart is often decided in the same pass as the restart is first counted
    (both reported while the daemon was down; a DOWN and a crash a poll apart), and the restart
    must be counted free at once, never charged to the user's code for a pass (that pass could
    stop the run at the cap). Its own drain gate: which node leaves does not depend on the drain
    limits. A straggler's exclusion is left out: it comes before the restart it causes."""
    job = run.job
    if job is None or run.cancel_requested or job.phase is JobPhase.ENDED:
        return set()
    if job.phase is JobPhase.WAITING:
        return _lost_nodes(run, view, policy, _DrainGate(policy.trust, view))[1]
    if job.batch_host and _batch_host_lost(run, job, view, policy):
        return {job.batch_host}
    gate = _DrainGate(policy.trust, view)
    return set().union(*(finder(run, view, policy, gate)[1] for finder in _removal_finders(lemons)))


class _EventFields(TypedDict, total=False):
    """RecordEvent's fields that _event passes through."""

    reason: Required[str]
    evidence: dict[str, Any]
    kind: EventKind
    fault_class: FaultClass | None
    node: str | None
    rank: int | None


def _event(run: RunView, key: str, **kwargs: Unpack[_EventFields]) -> list[Action]:
    """A RecordEvent unless this finding was recorded before."""
    if key in run.reported:
        return []
    return [RecordEvent(run.run_id, key=key, **kwargs)]


def _stop(run: RunView, reason: str, job_id: str | None = None) -> list[Action]:
    """The run ends STOPPED (its job cancelled if it still runs), and a person is told."""
    return [
        FinishRun(run.run_id, reason, state=RunState.STOPPED, job_id=job_id),
        NotifyHuman(run.run_id, f"run {run.run_id} stopped: {reason}"),
    ]


def _job_ended(run: RunView, job: JobView, view: ClusterView) -> list[Action]:
    exclude = view.denylist | run.excluded
    end = job.end or JobEnd.FAILED
    if end is JobEnd.FINISHED:
        return [FinishRun(run.run_id, "the training script finished", state=RunState.COMPLETED)]
    if end is JobEnd.GIVE_UP:
        return _stop(
            run, "the batch step stopped at the restart budget: " + run.budget.stop_reason()
        )
    # One new job per ended job: the key makes a resubmission that is waiting (for the owner,
    # or for a failed sbatch to be retried) not come again on every pass.
    resubmit_key = f"resubmit:{job.job_id}"
    if resubmit_key in run.reported:
        return []
    if end is JobEnd.CANCELLED:
        # Slurm ends a job preempted under PreemptMode=CANCEL as PREEMPTED; CANCELLED is
        # scancel by its owner or an admin, and someone who cancels a job means it.
        reason = (
            "cancelled by its owner"
            if run.cancel_requested
            else f"job {job.job_id} was cancelled outside slurmft (scancel by its owner or an "
            f"admin); the run ends with it"
        )
        return [FinishRun(run.run_id, reason, state=RunState.CANCELLED)]
    if end in {JobEnd.TIME_LIMIT, JobEnd.PREEMPTED}:
        # Expected ends: not failures, not charged.
        kind = EventKind.TIME_LIMIT if end is JobEnd.TIME_LIMIT else EventKind.PREEMPTED
        reason = f"job {job.job_id} ended ({end.value}); resubmitting from the last checkpoint"
        return [
            *_event(
                run,
                f"end:{job.job_id}",
                reason=reason,
                kind=kind,
                fault_class=FaultClass.TIME_LIMIT
                if end is JobEnd.TIME_LIMIT
                else FaultClass.PREEMPTION,
            ),
            SubmitAttempt(run.run_id, reason, {"key": resubmit_key}, exclude=exclude),
        ]
    cause = FaultClass.HARDWARE if end is JobEnd.NODE_FAIL else FaultClass.USER_CODE
    budget = run.budget.charge(Restart(cause, node_removed=end is JobEnd.NODE_FAIL))
    if budget.exhausted:
        return _stop(run, budget.stop_reason())
    reason = f"job {job.job_id} ended ({end.value}); resubmitting, {budget.remaining} restarts left"
    return [
        SubmitAttempt(
            run.run_id,
            reason,
            {"key": resubmit_key},
            exclude=exclude,
            restarts_without_progress=budget.restarts_without_progress,
        )
    ]


def _batch_host_down(run: RunView, job: JobView, view: ClusterView, policy: Policy) -> list[Action]:
    host = job.batch_host or ""
    reason = (
        f"slurmft: batch host {host} of job {job.job_id} is down; the job cannot recover "
        f"inside its allocation, requeueing without it"
    )
    actions = _event(
        run,
        f"batch_host_down:{job.job_id}:{host}",
        reason=reason,
        kind=EventKind.BATCH_HOST_DOWN,
        fault_class=FaultClass.HARDWARE,
        node=host,
    )
    if host not in run.excluded:
        actions.append(ExcludeNode(run.run_id, reason, node=host))
    silent = _silent_held(run, job)
    if silent:
        fences = _fences(run, job, silent, view, policy)
        return actions + fences  # the requeue once Slurm shows them DOWN
    exclude = view.denylist | run.excluded | {host}
    return [*actions, RequeueJob(run.run_id, reason, job_id=job.job_id, exclude=exclude)]


def _silent_held(run: RunView, job: JobView) -> list[str]:
    """The silent nodes a GRES job holds, which must be DOWN before it is requeued. Slurm 22.05
    breaks the GPUs of a job requeued while it holds a node whose slurmd is gone but that is
    not DOWN yet: its next attempt's GPU steps are refused and the GPUs of its new nodes leak
    (docs/slurm.md). Once DOWN, the node is out of the --no-kill job and the requeue is clean."""
    return sorted(job.silent_nodes) if run.steps_ask_gres else []


def _fences(
    run: RunView, job: JobView, silent: list[str], view: ClusterView, policy: Policy
) -> list[Action]:
    """DOWN for each silent node whose silence is confirmed, once per job. Slurm sets the same
    DOWN itself after SlurmdTimeout (minutes on most sites), and kills what else runs there:
    slurmft only does it sooner. Where the DOWN fails or is refused, the requeue waits for
    Slurm's own; a node silent for a moment only (not confirmed) is waited for, not set DOWN."""
    fences: list[Action] = []
    for node in silent:
        key = f"fence:{job.job_id}:{node}"
        if key not in run.reported and _confirmed(
            run, node, _lost_since(run, job, node), view, policy
        ):
            reason = (
                f"slurmft: node {node} silent (slurmd not responding): DOWN so that GPU job "
                f"{job.job_id} is requeued without it"
            )
            fences.append(EvictNode(run.run_id, reason, {"key": key}, node=node))
    return fences


def _keep_excluded(run: RunView, job: JobView, view: ClusterView) -> list[Action]:
    """The run's removed nodes kept out of its waiting job in Slurm's own record: a requeued
    job starts again within seconds on what Slurm offers, a revived node included. Whoever
    requeued it (the daemon or the batch step), the list is set here, once per attempt and
    node set (a refusal is tried again a minute later): 22.05 refuses every update of a job
    that lost a node until its requeue completes, so the requeue's own update may not stick
    (docs/slurm.md)."""
    if not run.excluded:
        return []
    nodes = view.denylist | run.excluded
    digest = hashlib.sha256(",".join(sorted(nodes)).encode()).hexdigest()[:16]
    key = f"exclude:{job.job_id}:{digest}"
    if key in run.reported:
        return []
    reason = f"slurmft: keep {', '.join(sorted(run.excluded))} out of job {job.job_id}"
    return [ExcludeFromJob(run.run_id, reason, {"key": key}, job_id=job.job_id, nodes=nodes)]


def _confirmed(
    run: RunView, node: str, since: datetime | None, view: ClusterView, policy: Policy
) -> bool:
    """Slurm's word that ``node`` is lost, confirmed (the confirmed Slurm fact of docs/design.md):
    it has held for ``policy.confirm_s``, or the node's agent has been silent as long (the
    second source: its keep-alive comes at least every 2 s). ``since`` None: not in doubt.
    Slurm was seen marking a just-resumed node not responding for under a second."""
    if since is None or (view.now - since).total_seconds() >= policy.confirm_s:
        return True
    heard = max((a.last_report_at for a in run.agents if a.node == node), default=None)
    if heard is None:
        return False
    return (view.now - view.heard(heard)).total_seconds() >= policy.confirm_s


def _lost_since(run: RunView, job: JobView, node: str) -> datetime | None:
    """Since when Slurm has called ``node`` (one the job holds) lost, as observe saw it."""
    if node == job.batch_host and job.batch_host_lost_since is not None:
        return job.batch_host_lost_since
    return next((n.lost_since for n in run.nodes if n.name == node), None)


def _lost_nodes(
    run: RunView, view: ClusterView, policy: Policy, gate: _DrainGate
) -> tuple[list[Action], set[str]]:
    actions: list[Action] = []
    removed: set[str] = set()
    for node in run.nodes:
        if node.name in run.excluded or node.condition is NodeCondition.OK:
            continue
        if node.condition is NodeCondition.LOST:
            if not _confirmed(run, node.name, node.lost_since, view, policy):
                continue  # Slurm's word alone, not for long yet: the next pass looks again
            reason = f"slurmft: node {node.name} lost ({node.role.value})"
            actions += _event(
                run,
                f"lost:{node.name}",
                reason=reason,
                kind=EventKind.NODE_LOST,
                fault_class=FaultClass.HARDWARE,
                node=node.name,
            )
        else:
            reason = f"slurmft: node {node.name} drained by someone else"
        actions.append(ExcludeNode(run.run_id, reason, node=node.name))
        removed.add(node.name)
    return actions, removed


def _gpu_faults(
    run: RunView, view: ClusterView, policy: Policy, gate: _DrainGate, *, lemons: frozenset[str]
) -> tuple[list[Action], set[str]]:
    actions: list[Action] = []
    removed: set[str] = set()
    own = _own_nodes(run)
    for fault in run.gpu_faults:
        if fault.key in run.reported or fault.node not in own:
            continue  # acted on already, or not the run's node to act on
        reason = f"slurmft: {fault.description}"
        evidence = {"key": fault.key, "xid": fault.xid, "gpu": fault.gpu}
        if fault.event_id is None:  # an agent's report is an event already
            actions += _event(
                run,
                fault.key,
                reason=reason,
                kind=EventKind.GPU_FAULT,
                fault_class=FaultClass.HARDWARE,
                node=fault.node,
                evidence=evidence,
            )
        if fault.node in run.excluded or fault.node in removed:
            continue
        # Restart-class Xids are usually the application's own bug: the node leaves only when
        # it is a lemon (such Xids on it across different runs).
        lemon = fault.action is FaultAction.RESTART_APP and fault.node in lemons
        if fault.action is FaultAction.RESTART_APP and not lemon:
            # The application must restart (a fresh CUDA context); the node stays. If the
            # fault already crashed it, torchrun has restarted it and this finds it healthy.
            actions.append(
                RestartWorkers(
                    run.run_id, f"{reason}: restart the application", evidence, node=fault.node
                )
            )
            continue
        if fault.action is not FaultAction.DRAIN and not lemon:
            continue  # record only
        if lemon:
            reason = (
                f"slurmft: lemon {fault.node}: restart-class Xids in several runs "
                f"({fault.description})"
            )
        actions.append(ExcludeNode(run.run_id, reason, evidence, node=fault.node))
        removed.add(fault.node)
        if lemon or policy.trust.drain_gpu_faults:
            actions += gate.drain(fault.node, run.run_id, reason, evidence)
    return actions, removed


def _unresponsive_nodes(
    run: RunView, view: ClusterView, policy: Policy, gate: _DrainGate
) -> tuple[list[Action], set[str]]:
    """A node whose agent stopped reporting while its peers report: evicted from the running job
    (drain, then DOWN: under --no-kill the job shrinks, it is not requeued).

    The node is still OK in Slurm (a node Slurm calls lost is `_lost_nodes`' business), so only
    slurmft can see it is useless. The evidence is the daemon's own, not the word of the run's
    processes: the node's agent went silent on the same channel its peers still report on, and
    a silent agent cannot restart anything, so a worker restart would not help. Evicting and
    draining weigh more than restarting workers, so the silence must last longer
    (policy.unresponsive_after_s, 60 s, against 30 s for a silent rank): a live agent starved of
    CPU for a while must not cost its node. The exclusion
    and the DOWN touch only this run's allocation and go ahead at once. The drain keeps the node
    from everyone (without it DOWN does not stick while slurmd answers, and Slurm would hand the
    frozen node to the next job), so it goes through the drain rate limits like every other
    drain: past them a human is told instead, and the node returns to service once Slurm has
    killed the job's processes on it."""
    findings = find_unresponsive(
        {agent.node: view.heard(agent.last_report_at) for agent in run.agents},
        now=view.now,
        silent_after_s=policy.unresponsive_after_s,
    )
    actions: list[Action] = []
    removed: set[str] = set()
    usable = {n.name for n in run.nodes if n.condition is NodeCondition.OK}
    for finding in findings:
        node = finding.node
        if node in run.excluded or node not in usable:
            continue  # gone already, or Slurm itself says it is lost
        evidence = {"seconds": round(finding.seconds, 1)}
        actions += _event(
            run,
            f"unresponsive:{node}",
            reason=finding.reason,
            kind=EventKind.NODE_LOST,
            fault_class=FaultClass.HARDWARE,
            node=node,
            evidence=evidence,
        )
        actions.append(ExcludeNode(run.run_id, finding.reason, evidence, node=node))
        actions += gate.drain(node, run.run_id, finding.reason, evidence)
        actions.append(EvictNode(run.run_id, finding.reason, evidence, node=node))
        removed.add(node)
    return actions, removed


# Past this after the daemon's start, every rank's receipt is later than the start anyway (or the
# rank is silent far longer than any threshold): the beats need no rewriting.
_RECENT_START = timedelta(hours=1)


def _hangs(run: RunView, view: ClusterView, policy: Policy, removed: set[str]) -> list[Action]:
    beats = run.beats
    if view.listening_since is not None and view.now - view.listening_since < _RECENT_START:
        # Just started: a rank last heard before the daemon's start is silent since then only.
        beats = tuple(b._replace(received_at=view.heard(b.received_at)) for b in beats)
    findings, silence = find_hangs(beats, now=view.now, silent_after_s=policy.silent_after_s)
    if silence is not None:
        reason = (
            f"slurmft: all {silence.ranks} ranks silent for {silence.seconds:.0f}s: "
            f"report channel or agents unreachable, not a hang; no action"
        )
        return _event(
            run,
            "silence",
            reason=reason,
            kind=EventKind.CHANNEL_SILENT,
            fault_class=FaultClass.INFRASTRUCTURE,
        )
    actions: list[Action] = []
    restarted: set[str] = set()
    for finding in findings:
        if finding.node in run.excluded or finding.node in removed:
            continue  # its node is already leaving the run
        # One finding per rank, phase and step: the same rank hung again later in the attempt
        # (after its workers were restarted) is a new hang, restarted again.
        key = f"hang:{finding.rank}:{finding.phase}:{finding.kind.value}:{finding.step}"
        actions += _event(
            run,
            key,
            reason=finding.reason,
            kind=EventKind.HANG,
            fault_class=FaultClass.HANG,
            node=finding.node,
            rank=finding.rank,
            evidence={"seconds": finding.seconds, "phase": finding.phase},
        )
        if finding.node not in restarted and key not in run.reported:
            actions.append(RestartWorkers(run.run_id, finding.reason, node=finding.node))
            restarted.add(finding.node)
    return actions


def _stragglers(
    run: RunView, view: ClusterView, policy: Policy, gate: _DrainGate, removed: set[str]
) -> tuple[list[Action], set[str]]:
    findings = find_stragglers(
        run.compute,
        threshold=policy.straggler_threshold,
        window_buckets=policy.straggler_window_buckets,
    )
    actions: list[Action] = []
    gone: set[str] = set()
    own = _own_nodes(run)
    for finding in findings:
        node = finding.node
        if node in run.excluded or node in removed or node in gone or node not in own:
            continue  # a node outside the run's allocation is never judged by its step times
        actions += _event(
            run,
            f"straggler:{node}",
            reason=finding.reason,
            kind=EventKind.STRAGGLER,
            fault_class=FaultClass.STRAGGLER,
            node=node,
            rank=finding.rank,
            evidence={"margin": round(finding.margin, 3)},
        )
        if not _has_spare(run, removed | gone):
            continue  # a slow run beats a smaller one: keep the node until a spare exists
        actions.append(ExcludeNode(run.run_id, finding.reason, node=node))
        gone.add(node)
        windows = view.straggler_windows.get(node, 0) + 1
        if windows >= policy.trust.straggler_drain_after_windows:
            actions += gate.drain(node, run.run_id, f"{finding.reason}, slow in {windows} windows")
    return actions, gone


def _own_nodes(run: RunView) -> frozenset[str]:
    """The run's own nodes: those Slurm gives its job and its allocation holds."""
    return frozenset(n.name for n in run.nodes)


def _usable(run: RunView, removed: set[str]) -> list[str]:
    return [
        n.name
        for n in run.nodes
        if n.name not in run.excluded and n.name not in removed and n.condition is NodeCondition.OK
    ]


def _has_spare(run: RunView, removed: set[str]) -> bool:
    return len(_usable(run, removed)) > run.nodes_needed


def _capacity(
    run: RunView, job: JobView, view: ClusterView, policy: Policy, removed: set[str]
) -> list[Action]:
    """Fewer usable nodes than the run needs: the allocation cannot recover, requeue it."""
    usable = _usable(run, removed)
    # Removed this pass, or on a pass that set its silent nodes DOWN first (_fences).
    fenced = any(key.startswith(f"fence:{job.job_id}:") for key in run.reported)
    if not (removed or fenced) or len(usable) >= run.nodes_needed:
        return []
    spares_left = sum(1 for n in run.nodes if n.role is NodeRole.SPARE and n.name in usable)
    reason = (
        f"slurmft: {len(usable)} usable nodes < {run.nodes_needed} needed "
        f"({spares_left} spares left); requeueing job {job.job_id} without "
        f"{', '.join(sorted(removed | run.excluded))}"
    )
    silent = _silent_held(run, job)
    if silent:
        return _fences(run, job, silent, view, policy)  # the requeue once they are DOWN
    key = f"requeue:{job.job_id}"  # once per attempt: the pass after the fences comes again
    if key in run.reported:
        return []
    exclude = view.denylist | run.excluded | removed
    return [
        RequeueJob(run.run_id, reason, {"key": key}, job_id=job.job_id, exclude=exclude),
        NotifyHuman(run.run_id, f"spares exhausted: {reason}"),
    ]
