"""Exit codes of `slurmft agent run`: what the batch step reads to decide what comes next."""

from __future__ import annotations

from enum import IntEnum


class AgentExit(IntEnum):
    FINISHED = 0  # torchrun ended with success: training is done
    FAILED = 1  # torchrun ended with a failure (see its output)
    USAGE = 2  # bad arguments or configuration
    SPARE_REFUSED = 3  # spares need the wait-list fix, which does not know this torch
    LEFT = 4  # told to leave (cordoned node) or stopped by a signal: a spare takes over
    PREFLIGHT_FAILED = 5  # the node is not fit to train (GPU fault)


class BatchExit(IntEnum):
    """Exit codes of the batch step (the job's batch script): what the controller reads from the
    job's ExitCode once it has ended. Self-requeues need no code: the job is pending again."""

    FINISHED = 0  # the training script completed
    FAILED = 1  # ended on a failure the batch step could not recover from
    REQUEUE_ME = 75  # (EX_TEMPFAIL) fewer than N usable nodes and the self-requeue was refused
    GAVE_UP = 76  # the restart budget is spent: a crash loop, stop the run
