"""Exit codes and outcomes: what the agent's and the batch step's ends tell whoever reads them.

`slurmft agent run` ends with an :class:`AgentExit` and writes its :class:`StepOutcome` into the
step's outcome folder, which the batch step reads to decide what comes next (srun reports only
the highest exit code of its tasks); the batch step ends with a :class:`BatchExit`, which the
daemon reads from Slurm's ExitCode (``N:0``) of the job.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class AgentExit(IntEnum):
    FINISHED = 0  # torchrun ended with success: training is done
    FAILED = 1  # torchrun ended with a failure (see its output)
    USAGE = 2  # bad arguments or configuration
    SPARE_REFUSED = 3  # spares need the wait-list fix, which does not know this torch
    LEFT = 4  # told to leave (cordoned node) or stopped by a signal: a spare takes over
    PREFLIGHT_FAILED = 5  # the node is not fit to train (GPU fault)
    FENCED = 6  # declared dead by its peers (frozen, then thawed): it must not train again


class BatchExit(IntEnum):
    """What the batch step's exit code tells the controller."""

    FINISHED = 0  # training ended with success
    GIVE_UP = 3  # the restart budget is spent: a crash loop, stop the run
    REQUEUE = 4  # fewer than N usable nodes (or time is up): requeue me (tried myself first)


class StepOutcome(StrEnum):
    """How one agent of an agent step ended, as written in the step's outcome folder: its
    AgentExit's name, or LEFT_CORDONED for an agent the controller told to leave (told apart
    from LEFT, a stop by signal: the batch step's own). The values are on disk: never renamed."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    USAGE = "USAGE"
    SPARE_REFUSED = "SPARE_REFUSED"
    LEFT = "LEFT"
    LEFT_CORDONED = "LEFT_CORDONED"
    PREFLIGHT_FAILED = "PREFLIGHT_FAILED"
    FENCED = "FENCED"

    @property
    def cordons(self) -> bool:
        """The node stays out of this job's later agent steps (cordoned, or unfit to train)."""
        return self in {StepOutcome.LEFT_CORDONED, StepOutcome.PREFLIGHT_FAILED, StepOutcome.FENCED}

    @property
    def departed(self) -> bool:
        """The agent left while the others went on: its node was taken out of the run."""
        return self in {StepOutcome.LEFT, StepOutcome.LEFT_CORDONED, StepOutcome.FENCED}
