"""slurmft's ladder in the simulator: the real policy decides.

At each control pass whose input changed, the simulated world is rendered as the daemon's
`ClusterView` (Slurm's view of the job, the agents' keep-alives, the ranks' heartbeats and step
times, the GPU faults, the restart history the budget is counted from) and handed to
`slurmft.controller.decide.decide`, looked up at call time (a test may replace it). Its actions
are applied to the world as the daemon's effects would be. The simulator decides nothing of its
own: what it models is what the agents and torchrun do without the daemon (a crashed worker
restarted in place; a silent peer dropped from the rendezvous and a waiting spare taking its
place; a node DOWN in Slurm leaving a --no-kill job).

Simplifications, each stated in docs/simulate.md: the ranks of one node share one heartbeat
and one step time; a requeue is a new attempt (its findings counted anew, as the store does from
the attempt's submission); restart-class Xids (and so lemon verdicts from them) are not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import ClassVar

from slurmft.controller import decide as policy_module
from slurmft.controller.views import (
    Action,
    AgentSeen,
    ClusterView,
    DrainNode,
    EvictNode,
    ExcludeFromJob,
    ExcludeNode,
    FinishRun,
    GpuFault,
    JobView,
    NodeCondition,
    NodeView,
    NotifyHuman,
    RankBeat,
    RankCompute,
    RecordEvent,
    RecordRestarts,
    RequeueJob,
    RestartEvidence,
    RestartWorkers,
    RunView,
    SubmitAttempt,
)
from slurmft.core.budget import CAUSE_WINDOW_S, RestartBudget, Seen, Sighting
from slurmft.core.kinds import EventKind, FaultClass, NodeRole
from slurmft.core.states import JobPhase, RunState
from slurmft.gpu.api import FaultAction
from slurmft.sim.engine import ACTIVE, JobState, Simulation

# The simulated clock's origin (any instant: only differences matter to the policy).
EPOCH = datetime(2026, 1, 5, tzinfo=UTC)
_WINDOW = timedelta(seconds=CAUSE_WINDOW_S)
_RUN = "sim"


def stamp(t: float) -> datetime:
    return EPOCH + timedelta(seconds=t)


@dataclass
class _Run:
    """What the store holds about the run, as far as the policy reads it."""

    started_at: float
    excluded: dict[str, float] = field(default_factory=dict)  # node -> when it left the run
    reported: set[str] = field(default_factory=set)  # this attempt's finding keys
    attempt: str = ""
    failures: list[Sighting] = field(default_factory=list)  # FAILURE and RESTART reports
    causes: list[Sighting] = field(default_factory=list)  # NODE_REMOVED and HANG
    last_checkpoint: Sighting | None = None
    stored_count: int = 0
    progress_at: datetime | None = None
    recorded: dict[str, tuple[FaultClass | None, bool]] = field(default_factory=dict)
    # The GPU faults reported in this attempt: (node, when) -> the report's event id.
    gpu_faults: dict[tuple[str, float], int] = field(default_factory=dict)


class Ladder:
    """The `Recovery` of the ladder strategy."""

    def __init__(self, policy: policy_module.Policy | None = None) -> None:
        self.policy = policy or policy_module.Policy()
        self.denylist: set[str] = set()
        self.drain_times: list[float] = []
        self.straggler_windows: dict[str, int] = {}
        self._pending: set[float] = set()
        self._fault_ids = 0
        self._healthy: dict[tuple[str, NodeRole], NodeView] = {}

    # --- Recovery hooks: the world around the daemon ------------------------------------------

    def start(self, sim: Simulation) -> None:
        self.sim = sim
        self.run: _Run | None = _Run(started_at=sim.now)

    def attempt_started(self, t: float) -> None:
        self._watch(t, 0.0)

    def software(self, t: float, node: str) -> None:
        # torchrun restarts the workers in place on its own (a worker failure ends the round).
        self.sim.restart_round(t, self.sim.inputs.restart_in_place_s, "software")

    def hang(self, t: float) -> None:
        # Only the heartbeats' deadline can tell (the daemon's hang detector), unless torch's
        # own watchdog ends the collective first (then torchrun restarts).
        self._watch(t, self.sim.inputs.hang_deadline_s)
        self.sim.at(t + self.sim.inputs.nccl_timeout_s, self._watchdog, self.sim.job.id, t)

    def _watchdog(self, job_id: str, hung_at: float) -> None:
        job = self.sim.job
        if job.id == job_id and job.state is JobState.HUNG and job.since == hung_at:
            self.sim.restart_round(self.sim.now, self.sim.inputs.restart_in_place_s, "hang")

    def gpu_fault(self, t: float, node: str, member: bool) -> None:
        # The agent's GPU check reports it; the policy takes the node out.
        self._watch(t, self.sim.inputs.gpu_report_s)

    def nodes_lost(self, t: float, members: list[str], others: list[str]) -> None:
        if members:
            # The survivors' rendezvous drops the silent peers and a waiting spare joins
            # (the agents, without the daemon).
            self.sim.at(t + self.sim.inputs.dead_peer_s, self._dead_peers, set(members))
        # Slurm's word, the agents' silence, the frozen ranks: each has its own threshold.
        i, p = self.sim.inputs, self.policy
        self._watch(t, p.confirm_s, p.silent_after_s, p.unresponsive_after_s, i.slurmd_timeout_s)

    def straggler(self, t: float, node: str) -> None:
        self._watch_stragglers(t)

    def round_ended(self, t: float, key: str) -> None:
        if self.run:
            self.run.failures.append(Sighting(Seen.FAILURE, stamp(t), agent="w", round=key))
        self._watch(t, 0.0, self.policy.confirm_s)  # the budget; a crash loop's stop

    def round_done(self, t: float, key: str) -> None:
        if self.run:
            self.run.failures.append(Sighting(Seen.RESTART, stamp(t), agent="a", round=key))
        self._watch(t, 0.0)
        self._watch_stragglers(t)

    def checkpoint(self, t: float, step: int) -> None:
        if self.run:
            self.run.last_checkpoint = Sighting(Seen.CHECKPOINT, stamp(t), step=step)

    def repaired(self, t: float, node: str) -> None:
        self.denylist.discard(node)
        job = self.sim.job
        if node in job.allocation and node not in job.members and node not in job.spares:
            job.allocation.remove(node)  # Slurm took it out of the --no-kill job when DOWN
        if self.run and node not in job.allocation:
            self.run.excluded.pop(node, None)

    # --- the agents' own recovery --------------------------------------------------------------

    def _dead_peers(self, dead: set[str]) -> None:
        job = self.sim.job
        leaving = dead & set(job.members)
        if job.state in ACTIVE and leaving:
            self._reform(self.sim.now, leaving, "node")

    def _reform(self, t: float, leaving: set[str], blame: str) -> None:
        """``leaving`` leave the training: a new round with spares in their places, or, with
        too few spares or the batch host dead, training waits for the daemon's requeue. (A
        batch host that is only excluded, a straggler or a bad GPU, still runs the batch step:
        its training place goes to a spare like any other's.)"""
        sim = self.sim
        sim.round_ends(t)
        sim.block(t, blame)
        host = sim.partition[sim.job.batch_host]
        if host.dead_since is None and sim.replace(t, leaving):
            sim.restart_round(t, sim.inputs.spare_swap_s, blame)
        else:
            sim.job.members = [m for m in sim.job.members if m not in leaving]
        self._watch(t, 0.0)

    # --- control passes ------------------------------------------------------------------------

    def _watch(self, t: float, *offsets: float) -> None:
        """Passes when the thresholds ``offsets`` after a change at ``t`` fall due, and a poll
        later (a threshold is passed strictly)."""
        for offset in offsets:
            self._pass_at(t + offset)
            self._pass_at(t + offset + self.sim.inputs.poll_s)

    def _watch_stragglers(self, t: float) -> None:
        if self.sim.straggling(t):
            window = self.policy.straggler_window_s
            self._pass_at(t + window + window / self.policy.straggler_window_buckets)

    def _pass_at(self, t: float) -> None:
        poll = self.sim.inputs.poll_s
        grid = math.ceil(t / poll - 1e-9) * poll
        if grid in self._pending or grid > self.sim.inputs.horizon_s:
            return
        self._pending.add(grid)
        self.sim.at(grid, self._pass, grid)

    def _pass(self, grid: float) -> None:
        self._pending.discard(grid)
        if self.run is None:
            return  # stopped: nothing of it left to decide
        t = self.sim.now
        view = self.view(t)
        actions = policy_module.decide(view, self.policy)
        self.sim.counts.passes += 1
        changed = [self._apply(t, action) for action in actions]  # every one, in order
        if any(changed):
            self._pass_at(t + self.sim.inputs.poll_s)

    # --- the view ------------------------------------------------------------------------------

    def view(self, t: float) -> ClusterView:
        now = stamp(t)
        cutoff = t - 3600.0
        self.drain_times = [d for d in self.drain_times if d > cutoff]
        return ClusterView(
            now=now,
            slurm_reachable=True,
            runs=(self._run_view(t, now),) if self.run else (),
            denylist=frozenset(self.denylist),
            drains_last_hour=len(self.drain_times),
            partition_nodes=len(self.sim.partition.nodes),
            drained_nodes=self.sim.partition.drained(),
            straggler_windows=dict(self.straggler_windows),
            listening_since=EPOCH - timedelta(days=1),
        )

    def _run_view(self, t: float, now: datetime) -> RunView:
        run, job, sim = self.run, self.sim.job, self.sim
        assert run is not None
        if run.attempt != job.id:  # findings are counted per attempt (since its submission)
            run.attempt, run.reported, run.gpu_faults = job.id, set(), {}
        budget = RestartBudget(
            max_restarts_without_progress=self.policy.max_restarts_without_progress,
            restarts_without_progress=run.stored_count,
        )
        common = {
            "run_id": _RUN,
            "nodes_needed": sim.inputs.nodes,
            "excluded": frozenset(run.excluded),
            "steps_ask_gres": True,
            "budget": budget,
            "restarts": self._evidence(run),
            "reported": frozenset(run.reported),
        }
        if job.state is JobState.WAITING:
            return RunView(job=JobView(job.id, JobPhase.WAITING), **common)  # type: ignore[arg-type]
        nodes = tuple(self._node_view(name) for name in job.allocation)
        host = next((n for n in nodes if n.name == job.batch_host), None)
        host_lost = host is not None and host.condition is NodeCondition.LOST
        silent = frozenset(
            n
            for n in job.allocation
            if sim.partition[n].dead_since is not None and self._lost_at(n) is None
        )
        job_view = JobView(
            job.id,
            JobPhase.ACTIVE,
            batch_host=job.batch_host,
            batch_host_down=host_lost,
            batch_host_lost_since=host.lost_since if host_lost and host else None,
            silent_nodes=silent,
        )
        return RunView(
            job=job_view,
            nodes=nodes,
            beats=self._beats(t, now),
            compute=self._compute(t),
            gpu_faults=self._gpu_faults(t),
            agents=tuple(self._agent(now, name) for name in job.allocation),
            **common,  # type: ignore[arg-type]
        )

    def _lost_at(self, name: str) -> float | None:
        """Since when Slurm calls the node lost: set DOWN, or silent past SlurmdTimeout."""
        node = self.sim.partition.by_name[name]
        if node.down_at is None and node.dead_since is None:
            return None
        times = []
        if node.down_at is not None:
            times.append(node.down_at)
        if node.dead_since is not None:
            late = node.dead_since + self.sim.inputs.slurmd_timeout_s
            if late <= self.sim.now:
                times.append(late)
        return min(times) if times else None

    def _node_view(self, name: str) -> NodeView:
        role = NodeRole.SPARE if name in self.sim.job.spares else NodeRole.ACTIVE
        lost = self._lost_at(name)
        if lost is None:
            cached = self._healthy.get((name, role))  # most nodes, most passes: built once
            if cached is None:
                cached = self._healthy[(name, role)] = NodeView(name, role)
            return cached
        return NodeView(name, role, NodeCondition.LOST, stamp(lost))

    def _agent(self, now: datetime, name: str) -> AgentSeen:
        node, run = self.sim.partition.by_name[name], self.run
        assert run is not None
        if node.dead_since is not None:
            return AgentSeen(name, stamp(node.dead_since))
        if name in run.excluded:
            return AgentSeen(name, stamp(run.excluded[name]))  # it left the run then
        return AgentSeen(name, now)

    def _beats(self, t: float, now: datetime) -> tuple[RankBeat, ...]:
        job, sim = self.sim.job, self.sim
        state = job.state
        if state not in ACTIVE:
            return ()
        init = state in (JobState.STARTING, JobState.RESTARTING)
        phase = "init" if init else "step"
        # slurmft.train's init deadline (its DEFAULT_DEADLINES_S, which the simulator may not
        # import: no training code here).
        deadline = 900.0 if init else sim.inputs.hang_deadline_s
        age = 0.0 if state is JobState.TRAINING else t - job.since
        # The global step: the time trained that a checkpoint holds and since (1 step = 1 s).
        step = int(sim.ledger.effective_s + sim.ledger.uncommitted_s)
        beats = []
        for rank, name in enumerate(job.members):
            dead = sim.partition[name].dead_since
            heard = now if dead is None else stamp(dead)
            beats.append(RankBeat(rank, name, phase, step, heard, age, deadline))
        return tuple(beats)

    def _compute(self, t: float) -> tuple[RankCompute, ...]:
        """Each member's own compute time per bucket of the straggler window, from the round's
        start (fewer than a window's buckets: nothing to judge yet)."""
        job, sim = self.sim.job, self.sim
        if job.state is not JobState.TRAINING:
            return ()
        if not sim.straggling(t):
            return ()
        buckets = self.policy.straggler_window_buckets
        width = self.policy.straggler_window_s / buckets
        starts = [t - (buckets - k) * width for k in range(buckets)]
        starts = [s for s in starts if s >= job.since]
        slowdown = 1.0 + sim.inputs.straggler_slowdown
        out = []
        for rank, name in enumerate(job.members):
            node = sim.partition[name]
            slow_from = node.slow_until - sim.inputs.straggler_s
            values = tuple(
                slowdown if slow_from <= s + width / 2 < node.slow_until else 1.0 for s in starts
            )
            out.append(RankCompute(rank, name, values))
        return tuple(out)

    def _gpu_faults(self, t: float) -> tuple[GpuFault, ...]:
        """The drain-class GPU faults the run's agents have reported in this attempt."""
        run, sim = self.run, self.sim
        assert run is not None
        for name in sim.job.allocation:
            node = sim.partition[name]
            if node.gpu_fault_at is None or node.gpu_fault_at < sim.job.submitted_at:
                continue
            if t < node.gpu_fault_at + sim.inputs.gpu_report_s:
                continue
            if (name, node.gpu_fault_at) not in run.gpu_faults:
                self._fault_ids += 1
                run.gpu_faults[(name, node.gpu_fault_at)] = self._fault_ids
        return tuple(
            GpuFault(name, FaultAction.DRAIN, "Xid 79 GPU fell off the bus (GPU 0)", 79, 0, ident)
            for (name, _), ident in run.gpu_faults.items()
        )

    def _evidence(self, run: _Run) -> RestartEvidence:
        since = run.progress_at or stamp(run.started_at)
        run.failures = [s for s in run.failures if s.at >= since - 2 * _WINDOW]
        run.causes = [s for s in run.causes if s.at >= since - 3 * _WINDOW]
        newest = run.last_checkpoint
        return RestartEvidence(
            since=since,
            progress_at=run.progress_at,
            progress=newest if newest is not None and newest.at >= since else None,
            restarts=tuple(s for s in run.failures if s.at >= since - _WINDOW),
            causes=tuple(s for s in run.causes if s.at >= since - 2 * _WINDOW),
            recorded=dict(run.recorded),
        )

    # --- the daemon's effects ------------------------------------------------------------------

    def _apply(self, t: float, action: Action) -> bool:
        """Apply one action to the world as the daemon's effect would; True when it changed
        something (a finding's key recorded counts: the next pass decides without it)."""
        run = self.run
        if run is None:
            return False  # stopped earlier in this pass
        self.sim.counts.actions += 1
        key = action.evidence.get("key") if action.evidence else None
        new_key = isinstance(key, str) and key not in run.reported
        if isinstance(key, str):
            run.reported.add(key)
        effect = self._effects.get(type(action))
        if effect is None:
            raise TypeError(f"the simulator cannot apply {type(action).__name__}")
        return effect(self, t, action, run) or new_key

    def _record_event(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, RecordEvent)
        if action.key in run.reported:
            return False
        run.reported.add(action.key)
        if action.kind is EventKind.STRAGGLER and action.node:
            windows = self.straggler_windows
            windows[action.node] = windows.get(action.node, 0) + 1
        return True

    def _record_restarts(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, RecordRestarts)
        run.stored_count = action.restarts_without_progress
        run.progress_at = action.last_progress_at
        for r in action.restarts:
            run.recorded[r.key] = (r.cause, r.node_removed)
        return True

    def _exclude_node(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, ExcludeNode)
        return self._exclude(t, action.node, action.reason)

    def _drain(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, DrainNode)
        if action.node in self.denylist:
            return False
        self.denylist.add(action.node)
        self.drain_times.append(t)
        self.sim.drain(t, action.node)
        return True

    def _evict(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, EvictNode)
        target = self.sim.partition[action.node]
        if target.down_at is not None:
            return False
        target.down_at = t  # DOWN: under --no-kill the job shrinks to its other nodes
        return True

    def _restart(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, RestartWorkers)
        return self._restart_workers(t, action.node)

    def _requeue(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, RequeueJob | SubmitAttempt)
        self.sim.requeue(t, "requeue", frozenset(action.exclude))
        self._watch(t, 0.0)
        return True

    def _finish(self, t: float, action: Action, run: _Run) -> bool:
        assert isinstance(action, FinishRun)
        if action.state is not RunState.STOPPED:
            raise RuntimeError(f"the simulated run cannot end {action.state.value}: {action}")
        self.sim.stop(t)
        self.run = None
        return True

    def _notify(self, t: float, action: Action, run: _Run) -> bool:
        self.sim.counts.notices += 1
        return False

    def _keep_out(self, t: float, action: Action, run: _Run) -> bool:
        return False  # ExcludeFromJob: the next attempt's nodes are chosen without them anyway

    _effects: ClassVar[dict[type[Action], Callable[[Ladder, float, Action, _Run], bool]]] = {
        RecordEvent: _record_event,
        RecordRestarts: _record_restarts,
        ExcludeNode: _exclude_node,
        DrainNode: _drain,
        EvictNode: _evict,
        RestartWorkers: _restart,
        RequeueJob: _requeue,
        SubmitAttempt: _requeue,
        FinishRun: _finish,
        NotifyHuman: _notify,
        ExcludeFromJob: _keep_out,
    }

    def _exclude(self, t: float, node: str, reason: str) -> bool:
        run, job = self.run, self.sim.job
        assert run is not None
        if node in run.excluded:
            return False
        run.excluded[node] = t
        run.causes.append(Sighting(Seen.NODE_REMOVED, stamp(t)))
        if job.state not in ACTIVE:
            return True
        if node in job.spares:
            job.spares.remove(node)
        elif node in job.members:
            # Told to leave, its agent stops its workers: the round ends and a spare joins.
            blame = "straggler" if "straggler" in reason else "gpu"
            self._reform(t, {node}, blame)
        return True

    def _restart_workers(self, t: float, node: str) -> bool:
        """The agent kills the node's (hung) workers; torchrun's next round restarts them all."""
        sim, run = self.sim, self.run
        assert run is not None
        job = sim.job
        if job.state is not JobState.HUNG or sim.partition[node].dead_since is not None:
            return False  # nothing hung there, or no agent left to fetch the command
        run.causes.append(Sighting(Seen.HANG, stamp(t)))
        sim.restart_round(t, sim.inputs.restart_in_place_s, "hang")
        return True
