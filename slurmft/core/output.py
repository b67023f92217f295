"""How a worker's lines are labelled in the job's output, for `slurmft logs --rank`.

torchrun tees each worker's stdout and stderr through a file on its node and writes every line
to the job's output behind a prefix made from ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``; the
agent sets it to name the worker's global rank. After an elastic restart a rank number may
belong to another process (on another node): the label is the rank the line was written as.
"""

from __future__ import annotations

import re

RANK_LABEL_TEMPLATE = "[rank${rank}]: "  # torchrun substitutes ${rank} with the global rank
_RANK_LABEL = re.compile(r"\[rank(\d+)\]: ")


def rank_line(line: str) -> tuple[int, str] | None:
    """The rank a line of the job's output was written by, and the line without its label;
    None for a line that is not a worker's (the batch step's, an agent's, torchrun's own)."""
    found = _RANK_LABEL.match(line)
    if found is None:
        return None
    return int(found.group(1)), line[found.end() :]
