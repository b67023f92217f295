"""The discrete-event simulation of one training run: the job, its rendezvous rounds, its
checkpoints, the failures that hit it and the clock. How failures are recovered from is the
strategy's (`Recovery`): slurmft's ladder asks the real policy (slurmft.sim.ladder), the
baselines are plain world behaviour (slurmft.sim.baselines).

Event-driven: nothing is computed between events; the policy is asked only at the control
passes its input changed for (scheduled by the ladder at the times its thresholds fall due).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from slurmft.sim.cluster import Failure, FailureDraws, Node, Partition
from slurmft.sim.inputs import Hit, Inputs, Strategy
from slurmft.sim.ledger import Ledger, Loss, Mode


class JobState(StrEnum):
    """The job as its torchrun agents see it.

    WAITING -> STARTING -> TRAINING <-> RESTARTING (a new rendezvous round)
    TRAINING -> HUNG (a collective that never returns) | BLOCKED (a member lost, no round yet)
    any -> ENDED (requeued, stopped; the next attempt is a new job)
    """

    WAITING = "waiting"
    STARTING = "starting"
    TRAINING = "training"
    RESTARTING = "restarting"
    HUNG = "hung"
    BLOCKED = "blocked"
    ENDED = "ended"


ACTIVE = frozenset(
    {JobState.STARTING, JobState.TRAINING, JobState.RESTARTING, JobState.HUNG, JobState.BLOCKED}
)


@dataclass
class Job:
    id: str
    submitted_at: float
    allocation: list[str] = field(default_factory=list)
    members: list[str] = field(default_factory=list)  # training, in rank order
    spares: list[str] = field(default_factory=list)  # waiting in the rendezvous
    state: JobState = JobState.WAITING
    since: float = 0.0  # in this state since
    round: int = 0  # the rendezvous round now running (or being formed)
    round_failed_at: float | None = None  # the round ended by a failure, not restarted yet

    @property
    def batch_host(self) -> str:
        return self.allocation[0] if self.allocation else ""

    def round_key(self) -> str:
        return f"{self.id}/{self.round}"


@dataclass
class Counts:
    interruptions: dict[str, int] = field(default_factory=dict)  # failures that hit training
    failures: int = 0  # every failure drawn, spares and idle moments included
    spares_used: int = 0
    drains: int = 0
    requeues: int = 0
    stops: int = 0
    notices: int = 0
    passes: int = 0  # control passes (decide calls)
    actions: int = 0


class Recovery(Protocol):
    """A strategy: what happens after each kind of failure. The engine has already applied
    the physical part (a node dead, training stopped); the strategy recovers."""

    def start(self, sim: Simulation) -> None: ...
    def attempt_started(self, t: float) -> None: ...
    def software(self, t: float, node: str) -> None: ...
    def hang(self, t: float) -> None: ...
    def gpu_fault(self, t: float, node: str, member: bool) -> None: ...
    def nodes_lost(self, t: float, members: list[str], others: list[str]) -> None: ...
    def straggler(self, t: float, node: str) -> None: ...
    def round_ended(self, t: float, key: str) -> None: ...
    def round_done(self, t: float, key: str) -> None: ...
    def checkpoint(self, t: float, step: int) -> None: ...
    def repaired(self, t: float, node: str) -> None: ...


@dataclass
class Result:
    inputs: Inputs
    ledger: Ledger
    counts: Counts

    @property
    def ettr(self) -> float:
        return self.ledger.ettr

    def lost_s(self) -> dict[str, float]:
        return {k.value: v for k, v in sorted(self.ledger.lost.items())}

    def summary(self) -> dict[str, Any]:
        ledger, counts = self.ledger, self.counts
        return {
            "strategy": self.inputs.strategy.value,
            "nodes": self.inputs.nodes,
            "gpus": self.inputs.gpus,
            "spares": self.inputs.spares,
            "seed": self.inputs.seed,
            "checkpoint_interval_s": self.inputs.interval_s(),
            "checkpoint_cost_s": self.inputs.checkpoint_cost_s,
            "ettr": ledger.ettr,
            "span_s": ledger.span_s,
            "effective_s": ledger.effective_s,
            "startup_s": ledger.startup_s,
            "slow_s": ledger.slow_s,
            "lost_s": self.lost_s(),
            "lost_by_class_s": dict(sorted(ledger.lost_by_class.items())),
            "interruptions": dict(sorted(counts.interruptions.items())),
            "failures": counts.failures,
            "spares_used": counts.spares_used,
            "drains": counts.drains,
            "requeues": counts.requeues,
            "stops": counts.stops,
            "notices": counts.notices,
            "passes": counts.passes,
        }


class Simulation:
    def __init__(self, inputs: Inputs, recovery: Recovery) -> None:
        self.inputs = inputs
        self.rng = random.Random(inputs.seed)
        self.partition = Partition(inputs, self.rng)
        self.draws = FailureDraws(inputs, self.rng)
        self.ledger = Ledger()
        self.counts = Counts()
        self.recovery = recovery
        self.interval_s = inputs.interval_s()
        self.now = 0.0
        self.job = Job("1", 0.0)
        self.attempts = 1
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._epoch = 0  # training's generation: stale checkpoint events are dropped
        self._draw = 0  # the failure draw's generation
        self.steps = 0  # checkpoints written (their global step, in checkpoint units)
        self.bug_until: float | None = None  # a software bug that repeats until fixed

    # --- the clock ---------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(t, self.now), self._seq, fn, args))

    def run(self) -> Result:
        horizon = self.inputs.horizon_s
        self.recovery.start(self)
        self.start_attempt(0.0, frozenset())
        if self.inputs.failure_every_s is not None:  # counted from the first step
            self.at(self.inputs.job_startup_s + self.inputs.failure_every_s, self._fixed_failure)
        while self._queue and self._queue[0][0] <= horizon:
            t, _, fn, args = heapq.heappop(self._queue)
            self.now = t
            fn(*args)
        self.now = horizon
        self.ledger.close(horizon)
        return Result(self.inputs, self.ledger, self.counts)

    # --- attempts ------------------------------------------------------------------------------

    def start_attempt(self, t: float, exclude: frozenset[str]) -> None:
        """A job (new, requeued or resubmitted) gets its nodes and starts up, or waits for
        enough nodes to come back from repair."""
        want = self.inputs.nodes + self.inputs.spares
        usable = self.partition.usable(exclude)
        if len(usable) < want:
            repairs = [n.repair_due for n in self.partition.nodes if n.repair_due is not None]
            if repairs:  # the job pends until enough nodes are back
                self.at(min(repairs), self.start_attempt, min(repairs), exclude)
                return
            if not exclude:
                raise RuntimeError(f"the partition cannot hold the job: {len(usable)} < {want}")
            # Only healthy nodes the run excluded keep it pending: a person lets them back in.
            self.counts.notices += 1
            self.at(
                t + self.inputs.human_fix_s,
                self.start_attempt,
                t + self.inputs.human_fix_s,
                frozenset(),
            )
            return
        job = self.job
        job.allocation = usable[:want]
        job.members = job.allocation[: self.inputs.nodes]
        job.spares = job.allocation[self.inputs.nodes :]
        self._set_state(JobState.STARTING, t)
        if self.ledger.first_step_at is not None:
            self.ledger.stall_for(t, Loss.RESTART)
        self.recovery.attempt_started(t)
        self._redraw(t)
        self.at(t + self.inputs.job_startup_s, self._started, self._epoch)

    def _started(self, epoch: int) -> None:
        if epoch != self._epoch or self.job.state is not JobState.STARTING:
            return
        self._train(self.now)

    def new_job(self, t: float, wait_s: float, exclude: frozenset[str]) -> None:
        """The job ends; the next attempt (a requeue or a resubmission) starts after ``wait_s``
        (Slurm's requeue delay and the queue wait) on nodes outside ``exclude``."""
        self.end_job(t)
        self.attempts += 1
        self.job = Job(str(self.attempts), t + wait_s)
        self.at(t + wait_s, self.start_attempt, t + wait_s, exclude)

    def end_job(self, t: float) -> None:
        self._set_state(JobState.ENDED, t)
        self._draw += 1  # no failures hit a job that holds no nodes

    def requeue(
        self, t: float, blame: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> None:
        self.counts.requeues += 1
        if self.job.state is JobState.TRAINING:
            self.ledger.fail(t, blame or "requeue")
        self.ledger.stall_for(t, Loss.QUEUE, blame)
        wait = self.inputs.requeue_delay_s + self.inputs.queue_wait_s
        self.new_job(t, wait, exclude)

    def stop(self, t: float) -> None:
        """The run is stopped (a crash loop): a person fixes the code and submits it again."""
        self.counts.stops += 1
        if self.job.state is JobState.TRAINING:
            self.ledger.fail(t, "software")
        self.ledger.stall_for(t, Loss.STOPPED)
        self.end_job(t)
        self.at(t + self.inputs.human_fix_s, self._fixed, t + self.inputs.human_fix_s)

    def _fixed(self, t: float) -> None:
        self.bug_until = None
        self.ledger.stall_for(t, Loss.QUEUE)
        self.new_job(t, self.inputs.queue_wait_s, frozenset())
        self.recovery.start(self)  # a new run: its own budget and history

    # --- rounds and training -------------------------------------------------------------------

    def _set_state(self, state: JobState, t: float) -> None:
        self.job.state = state
        self.job.since = t
        self._epoch += 1

    def _train(self, t: float) -> None:
        self._set_state(JobState.TRAINING, t)
        self.ledger.set_slowdown(t, self._slowdown(t))
        self.ledger.train(t)
        self._schedule_checkpoint(t)
        if self.bug_until is not None and t < self.bug_until:
            self.at(t + self.inputs.crash_loop_after_s, self._bug_strikes, self._epoch)

    def round_ends(self, t: float) -> None:
        """The running round ends by a failure (reported once, with its key)."""
        job = self.job
        if job.round_failed_at is None:
            job.round_failed_at = t
            self.recovery.round_ended(t, job.round_key())

    def restart_round(self, t: float, duration_s: float, blame: str | None = None) -> None:
        """A new rendezvous round with the members there are: training resumes after
        ``duration_s`` from the last durable checkpoint."""
        self.round_ends(t)
        self._set_state(JobState.RESTARTING, t)
        self.ledger.stall_for(t, Loss.RESTART, blame)
        self.at(t + duration_s, self._round_done, self._epoch)

    def _round_done(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        job = self.job
        self.recovery.round_done(self.now, job.round_key())
        job.round += 1
        job.round_failed_at = None
        self._train(self.now)

    def replace(self, t: float, leaving: set[str]) -> bool:
        """``leaving`` leave the members; spares fill their places. False: too few spares."""
        job = self.job
        job.members = [m for m in job.members if m not in leaving]
        job.spares = [s for s in job.spares if s not in leaving]
        while len(job.members) < self.inputs.nodes and job.spares:
            spare = next((s for s in job.spares if not self.partition[s].broken), None)
            if spare is None:
                break
            job.spares.remove(spare)
            job.members.append(spare)
            self.counts.spares_used += 1
        self._update_speed(t)
        self._redraw(t)
        return len(job.members) >= self.inputs.nodes

    def block(self, t: float, blame: str) -> None:
        """Training stops (a member lost) until something recovers it."""
        if self.job.state in (
            JobState.STARTING,
            JobState.TRAINING,
            JobState.HUNG,
            JobState.RESTARTING,
        ):
            self.ledger.fail(t, blame)
            self._set_state(JobState.BLOCKED, t)
            self.ledger.stall_for(t, Loss.DETECTION, blame)

    def _schedule_checkpoint(self, t: float) -> None:
        if math.isfinite(self.interval_s):
            wait = self.ledger.seconds_until_checkpoint(self.interval_s)
            self.at(t + wait, self._checkpoint_begins, self._epoch)

    def _checkpoint_begins(self, epoch: int) -> None:
        if epoch != self._epoch or self.job.state is not JobState.TRAINING:
            return
        self.ledger.begin_checkpoint(self.now)
        self._epoch += 1
        self.at(self.now + self.inputs.checkpoint_cost_s, self._checkpoint_ends, self._epoch)

    def _checkpoint_ends(self, epoch: int) -> None:
        if epoch != self._epoch or self.job.state is not JobState.TRAINING:
            return
        self.ledger.end_checkpoint(self.now)
        self.steps += 1
        self.recovery.checkpoint(self.now, self.steps)
        self._epoch += 1
        self._schedule_checkpoint(self.now)

    def straggling(self, t: float) -> bool:
        """A straggler trains: the job runs at its pace."""
        return any(self.partition[m].slow(t) for m in self.job.members)

    def _slowdown(self, t: float) -> float:
        return self.inputs.straggler_slowdown if self.straggling(t) else 0.0

    def _update_speed(self, t: float) -> None:
        slowdown = self._slowdown(t)
        if slowdown == self.ledger.slowdown:
            return
        in_checkpoint = self.ledger.mode is Mode.CHECKPOINT
        self.ledger.set_slowdown(t, slowdown)
        if self.job.state is JobState.TRAINING and not in_checkpoint:
            self._epoch += 1
            self._schedule_checkpoint(t)

    # --- failures ------------------------------------------------------------------------------

    def _redraw(self, t: float) -> None:
        self._draw += 1
        if self.job.state not in ACTIVE:
            return
        allocation = [
            self.partition[n] for n in self.job.allocation if not self.partition[n].broken
        ]
        failure = self.draws.next(t, allocation, self.job.members)
        if failure is not None:
            self.at(failure.at, self._failure, failure, self._draw)

    def _fixed_failure(self) -> None:
        hit, node = self.inputs.failure_every_hit, self.job.members[0] if self.job.members else ""
        self._apply(Failure(self.now, hit, node=node))
        self.at(self.now + (self.inputs.failure_every_s or math.inf), self._fixed_failure)

    def _failure(self, failure: Failure, draw: int) -> None:
        if draw != self._draw:
            return
        self._apply(failure)
        self._redraw(self.now)

    def _bug_strikes(self, epoch: int) -> None:
        if epoch == self._epoch and self.job.state is JobState.TRAINING:
            self._software(self.now, self.job.members[0], repeat=True)

    def _apply(self, f: Failure) -> None:
        t, job = f.at, self.job
        self.counts.failures += 1
        match f.hit:
            case Hit.SOFTWARE:
                self._software(t, f.node)
            case Hit.HANG:
                if job.state is JobState.TRAINING:
                    self._interrupted(Hit.HANG.value)
                    self.ledger.fail(t, Hit.HANG.value)
                    self._set_state(JobState.HUNG, t)
                    self.recovery.hang(t)
            case Hit.GPU:
                node = self.partition[f.node]
                node.gpu_fault_at = t
                self._schedule_repair(node, t)
                member = f.node in job.members
                if member:
                    self._interrupted(Hit.GPU.value)
                    self.round_ends(t)
                    self.block(t, Hit.GPU.value)
                self.recovery.gpu_fault(t, f.node, member)
            case Hit.NODE | Hit.SWITCH:
                hit = (
                    self.partition.rack(f.rack) if f.hit is Hit.SWITCH else [self.partition[f.node]]
                )
                dead = [n for n in hit if n.dead_since is None]
                # A switch is replaced in hours; its nodes were never broken themselves.
                fixed_in = self.inputs.switch_repair_s if f.hit is Hit.SWITCH else None
                for node in dead:
                    node.dead_since = t
                    self._schedule_repair(node, t, fixed_in)
                names = {n.name for n in dead}
                members = [m for m in job.members if m in names]
                others = [n for n in job.allocation if n in names and n not in members]
                if members:
                    self._interrupted(f.hit.value)
                    self.block(t, f.hit.value)
                if members or others:
                    self.recovery.nodes_lost(t, members, others)
            case None:
                node = self.partition[f.node]
                node.slow_until = t + self.inputs.straggler_s
                self.at(node.slow_until, self._update_speed_now)
                if f.node in job.members:
                    self._update_speed(t)
                self.recovery.straggler(t, f.node)

    def _software(self, t: float, node: str, repeat: bool = False) -> None:
        if self.job.state is not JobState.TRAINING or node not in self.job.members:
            return  # a bug only strikes in running code
        if not repeat and self.rng.random() < self.inputs.crash_loop_share:
            self.bug_until = t + self.inputs.human_fix_s
        self._interrupted(Hit.SOFTWARE.value)
        self.ledger.fail(t, Hit.SOFTWARE.value, Loss.RESTART)
        self.recovery.software(t, node)

    def _interrupted(self, hit: str) -> None:
        self.counts.interruptions[hit] = self.counts.interruptions.get(hit, 0) + 1

    def _update_speed_now(self) -> None:
        self._update_speed(self.now)

    def _schedule_repair(self, node: Node, t: float, after_s: float | None = None) -> None:
        if node.repair_due is None:
            node.repair_due = t + (self.inputs.repair_s if after_s is None else after_s)
            self.at(node.repair_due, self._repair, node)

    def drain(self, t: float, name: str) -> None:
        node = self.partition[name]
        if node.drained_at is None:
            node.drained_at = t
            self.counts.drains += 1
            self._schedule_repair(node, t)

    def _repair(self, node: Node) -> None:
        if node.repair_due is None or node.repair_due > self.now:
            return
        self.partition.repair(node)
        self.recovery.repaired(self.now, node.name)
        self._update_speed(self.now)


def simulate(inputs: Inputs) -> Result:
    """One seed of one strategy: the run's ledger and counts."""
    from slurmft.sim.baselines import InJobRestart, RequeueOnly
    from slurmft.sim.ladder import Ladder

    recovery: Recovery
    match inputs.strategy:
        case Strategy.LADDER:
            recovery = Ladder()
        case Strategy.IN_JOB:
            recovery = InJobRestart()
        case Strategy.REQUEUE:
            recovery = RequeueOnly()
    return Simulation(inputs, recovery).run()
