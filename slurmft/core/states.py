"""Run and attempt state machines, written down in one place, and what a Slurm job's state
means for a run (`JobPhase`: the Slurm client maps each state to one, the controller decides
by it).

An illegal transition raises :class:`IllegalTransition`; the models call :func:`check_transition`
whenever a state is assigned, so no code path can skip the rules.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class IllegalTransition(ValueError):
    """A state change that the state machine does not allow."""


class RunState(enum.StrEnum):
    """The life of a training run, across all of its Slurm jobs.

    ::

        PENDING ──► RUNNING ◄──► RECOVERING
           │           │             │
           ▼           ▼             ▼
        FAILED   COMPLETED · FAILED · CANCELLED · STOPPED
        CANCELLED

    - PENDING: recorded, no Slurm job accepted yet.
    - RUNNING: an attempt is running and training.
    - RECOVERING: something broke; a spare, a new step, a requeue or a new job is on the way.
    - COMPLETED: the training script finished successfully.
    - FAILED: the run cannot go on (submission refused, user code failed for good).
    - CANCELLED: a person cancelled it.
    - STOPPED: slurmft stopped it (crash loop: too many restarts without progress).
    """

    PENDING = "pending"
    RUNNING = "running"
    RECOVERING = "recovering"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self in _RUN_TERMINAL


_RUN_TERMINAL = frozenset(
    {RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.STOPPED}
)
RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.PENDING: frozenset({RunState.RUNNING, RunState.FAILED, RunState.CANCELLED}),
    RunState.RUNNING: frozenset(
        {
            RunState.RECOVERING,
            RunState.COMPLETED,
            RunState.FAILED,
            RunState.CANCELLED,
            RunState.STOPPED,
        }
    ),
    RunState.RECOVERING: frozenset(
        {
            RunState.RUNNING,
            RunState.COMPLETED,
            RunState.FAILED,
            RunState.CANCELLED,
            RunState.STOPPED,
        }
    ),
    **{state: frozenset() for state in _RUN_TERMINAL},
}


class AttemptState(enum.StrEnum):
    """One Slurm job submission, or one requeue of it (a requeue starts a new attempt).

    ::

        SUBMITTED ──► RUNNING ──► COMPLETED · FAILED · NODE_FAIL · TIMEOUT
            │            │        PREEMPTED · CANCELLED · REQUEUED · LOST
            ▼            │
        CANCELLED ◄──────┘
        FAILED · LOST

    - SUBMITTED: sbatch accepted the job (or Slurm requeued it); it waits in the queue.
    - RUNNING: Slurm runs it.
    - REQUEUED: this attempt ended by a requeue; the next attempt has the same Slurm job id.
    - LOST: the job vanished from Slurm without a known end (e.g. purged while unobserved).
    - the rest mirror Slurm's own end states.
    """

    SUBMITTED = "submitted"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    NODE_FAIL = "node_fail"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    CANCELLED = "cancelled"
    REQUEUED = "requeued"
    LOST = "lost"

    @property
    def is_terminal(self) -> bool:
        return self not in {AttemptState.SUBMITTED, AttemptState.RUNNING}


ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.SUBMITTED: frozenset(
        {AttemptState.RUNNING, AttemptState.CANCELLED, AttemptState.FAILED, AttemptState.LOST}
    ),
    AttemptState.RUNNING: frozenset(
        {
            AttemptState.COMPLETED,
            AttemptState.FAILED,
            AttemptState.NODE_FAIL,
            AttemptState.TIMEOUT,
            AttemptState.PREEMPTED,
            AttemptState.CANCELLED,
            AttemptState.REQUEUED,
            AttemptState.LOST,
        }
    ),
    **{state: frozenset() for state in AttemptState if state.is_terminal},
}


S = TypeVar("S", RunState, AttemptState)


def check_transition(current: S | None, new: S, table: dict[S, frozenset[S]]) -> None:
    """Raise :class:`IllegalTransition` unless ``current -> new`` is allowed by ``table``."""
    if current is None or current == new:
        return
    if new not in table[current]:
        allowed = ", ".join(sorted(s.value for s in table[current])) or "none (terminal)"
        raise IllegalTransition(
            f"{type(new).__name__} cannot go from {current.value} to {new.value}; "
            f"allowed from {current.value}: {allowed}"
        )


class JobPhase(enum.Enum):
    """What a job state means for the nodes and for the run."""

    WAITING = "waiting"  # queued: holds no nodes, will (or may) start
    ACTIVE = "active"  # holds nodes: running, or on its way in or out
    ENDED = "ended"  # final: Slurm will not run this job id again by itself
    UNKNOWN = "unknown"  # a state this table does not know (a newer Slurm): never act on it
