"""Where the simulated run's time goes: the effective ratio of docs/design.md, integrated exactly.

The run is in one mode at a time: starting (before its first step: reported apart), training,
blocked by a checkpoint write, or stalled for a cause. Time is added to the mode's account each
time the mode changes. Training time is effective once a durable checkpoint holds it, or when the
horizon comes first (those steps are never recomputed); a failure turns it into replay.
Invariant: effective + every loss = horizon - first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Loss(StrEnum):
    """Lost time, by what it was spent on (the definition's causes)."""

    DETECTION = "detection"  # from the failure until recovery starts
    RESTART = "restart"  # workers restarting, a spare joining, a requeued job starting up
    QUEUE = "queue"  # Slurm's requeue delay and the queue wait
    REPLAY = "replay"  # steps since the last durable checkpoint, recomputed
    CHECKPOINT = "checkpoint"  # training blocked while a checkpoint is written
    STOPPED = "stopped"  # a crash loop stopped, until a person fixes and resubmits


class Mode(StrEnum):
    STARTING = "starting"
    TRAINING = "training"
    CHECKPOINT = "checkpoint"
    STALLED = "stalled"


@dataclass
class Ledger:
    now: float = 0.0
    mode: Mode = Mode.STARTING
    stall: Loss = Loss.DETECTION
    blame: str = ""  # the failure class the current stall (and the next replay) is charged to
    slowdown: float = 0.0  # while a straggler trains: each step takes 1 + slowdown as long
    first_step_at: float | None = None
    startup_s: float = 0.0
    effective_s: float = 0.0
    uncommitted_s: float = 0.0  # training time a checkpoint does not hold yet
    work_since_checkpoint_s: float = 0.0  # the same in nominal (straggler-free) step time
    slow_s: float = 0.0  # training time spent waiting for a straggler (kept apart)
    lost: dict[Loss, float] = field(default_factory=dict)
    lost_by_class: dict[str, float] = field(default_factory=dict)

    def advance(self, to: float) -> None:
        """Add the time since the last change to the current mode's account."""
        dt = to - self.now
        if dt < 0:
            raise ValueError(f"time runs backwards: {self.now} -> {to}")
        self.now = to
        if dt == 0:
            return
        match self.mode:
            case Mode.STARTING:
                self.startup_s += dt
            case Mode.TRAINING:
                self.uncommitted_s += dt
                self.work_since_checkpoint_s += dt / (1.0 + self.slowdown)
                self.slow_s += dt * self.slowdown / (1.0 + self.slowdown)
            case Mode.CHECKPOINT:
                self._lose(Loss.CHECKPOINT, dt, "checkpoint")
            case Mode.STALLED:
                self._lose(self.stall, dt, self.blame)

    def _lose(self, loss: Loss, seconds: float, blame: str) -> None:
        self.lost[loss] = self.lost.get(loss, 0.0) + seconds
        self.lost_by_class[blame] = self.lost_by_class.get(blame, 0.0) + seconds

    def train(self, at: float) -> None:
        """Steps run (again) from the last durable checkpoint."""
        self.advance(at)
        if self.first_step_at is None:
            self.first_step_at = at
        self.mode = Mode.TRAINING
        self.work_since_checkpoint_s = 0.0

    def begin_checkpoint(self, at: float) -> None:
        self.advance(at)
        self.mode = Mode.CHECKPOINT

    def end_checkpoint(self, at: float) -> None:
        """The checkpoint is durable: the steps before it are never recomputed."""
        self.advance(at)
        self.effective_s += self.uncommitted_s
        self.uncommitted_s = 0.0
        self.work_since_checkpoint_s = 0.0
        self.mode = Mode.TRAINING

    def fail(self, at: float, blame: str, loss: Loss = Loss.DETECTION) -> None:
        """Training stops: the steps since the last checkpoint will be replayed."""
        self.advance(at)
        if self.mode is Mode.STARTING:
            self.stall_for(at, loss, blame)
            return
        if self.mode is not Mode.STALLED:
            self.blame = blame
        self._lose(Loss.REPLAY, self.uncommitted_s, self.blame)
        self.uncommitted_s = 0.0
        self.work_since_checkpoint_s = 0.0
        self.mode = Mode.STALLED
        self.stall = loss

    def stall_for(self, at: float, loss: Loss, blame: str | None = None) -> None:
        """The stall goes on, now spent on ``loss`` (detection, then restart...)."""
        self.advance(at)
        if self.mode is Mode.STARTING and self.first_step_at is None:
            return  # the first start-up is reported apart, whatever it waits on
        self.mode = Mode.STALLED
        self.stall = loss
        if blame is not None:
            self.blame = blame

    def set_slowdown(self, at: float, slowdown: float) -> None:
        self.advance(at)
        self.slowdown = slowdown

    def close(self, at: float) -> None:
        """The horizon: steps not yet checkpointed are never recomputed, so they count."""
        self.advance(at)
        self.effective_s += self.uncommitted_s
        self.uncommitted_s = 0.0

    @property
    def span_s(self) -> float:
        return 0.0 if self.first_step_at is None else self.now - self.first_step_at

    @property
    def ettr(self) -> float:
        span = self.span_s
        return self.effective_s / span if span > 0 else 0.0

    def seconds_until_checkpoint(self, interval_s: float) -> float:
        """Wall time of training until the next checkpoint starts, at the current speed."""
        left = max(0.0, interval_s - self.work_since_checkpoint_s)
        return left * (1.0 + self.slowdown)
