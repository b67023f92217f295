"""Exit codes: what the agent's and the batch step's exit statuses tell whoever reads them.

`slurmft agent run` ends with an :class:`AgentExit`, which the batch step reads to decide what
comes next; the batch step ends with a :class:`BatchExit`, which the daemon reads from Slurm's
ExitCode (``N:0``) of the job.
"""

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
    """What the batch step's exit code tells the controller."""

    FINISHED = 0  # training ended with success
    GIVE_UP = 3  # the restart budget is spent: a crash loop, stop the run
    REQUEUE = 4  # fewer than N usable nodes (or time is up): requeue me (tried myself first)
