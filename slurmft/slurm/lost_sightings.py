"""Since when Slurm has reported each node lost, held between polls by the daemon (its control
passes) and by the batch step (its checks of the agent step).

A node or batch-host state that changes a job's fate must hold for ``policy.confirm_s`` before
it is acted on, unless the node's agent confirms it by its own silence (docs/design.md: the
confirmed Slurm fact). Right after a node is resumed, Slurm has been seen to mark it not
responding for less than a second; one pass in that window must not requeue a run or exclude a
healthy node.
So each pass notes, for every node Slurm calls lost (DOWN or not responding), when it was first
seen so in an unbroken series of passes; a pass that sees it answering again forgets it.

Kept in memory: after a daemon restart a lost node is confirmed again from its next sighting
(``confirm_s`` later at most), and a node Slurm has DOWN or no longer lists is never in doubt.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from slurmft.slurm.api import NodeInfo


class LostSightings:
    def __init__(self) -> None:
        self._since: dict[str, datetime] = {}

    def update(self, nodes: Mapping[str, NodeInfo], now: datetime) -> Mapping[str, datetime]:
        """This pass's nodes: each lost one with the time it was first seen lost (``now`` for
        one seen lost for the first time)."""
        lost = (name for name, info in nodes.items() if info.status.lost)
        self._since = {name: self._since.get(name, now) for name in lost}
        return dict(self._since)
