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

