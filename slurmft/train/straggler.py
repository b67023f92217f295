"""Naming a straggler from every rank's own compute time.

Step time cannot name a straggler: a slow rank makes every rank's step slow (the others wait in
the all-reduce). Own compute time can: the slow rank's is high, the others' is normal. A rank is
named when the median, over a window of steps, of its compute time divided by the median of its
peers' exceeds 1 + threshold. Peers are the ranks of the same group (pipeline stages, or ranks
with different work by design, are separate groups). Single slow steps do not move the median.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from slurmft.train.report import ReportChannel


class PeerGroups:
    """Which ranks have comparable step times: `group_of_rank[r]` names rank r's group."""

    def __init__(self, group_of_rank: Sequence[str]):
        self.group_of_rank = list(group_of_rank)
        self._peers = [
            [other for other, g in enumerate(self.group_of_rank) if g == group and other != rank]
            for rank, group in enumerate(self.group_of_rank)
        ]

    @classmethod
    def uniform(cls, world_size: int) -> PeerGroups:
        return cls(["all"] * world_size)

    @property
    def world_size(self) -> int:
        return len(self.group_of_rank)

    def peers(self, rank: int) -> list[int]:
        return self._peers[rank]


@dataclass(frozen=True)
class Straggler:
    rank: int
    group: str
    ratio: float  # median over the window of own compute / peers' median compute
    window: int


class StragglerDetector:
    """Feed one vector of per-rank compute times per step; get the ranks slow over the window."""

    def __init__(self, groups: PeerGroups, window: int = 20, threshold: float = 0.2):
        self.groups = groups
        self.window = window
        self.threshold = threshold
        self._ratios: list[deque[float]] = [deque(maxlen=window) for _ in range(groups.world_size)]

    def observe(self, compute_s: Sequence[float]) -> list[Straggler]:
        if len(compute_s) != self.groups.world_size:
            raise ValueError(
                f"expected {self.groups.world_size} compute times, got {len(compute_s)}"
            )
        for rank, own in enumerate(compute_s):
            peers = self.groups.peers(rank)
            if not peers:
                continue
            reference = statistics.median(compute_s[p] for p in peers)
            if reference > 0:
                self._ratios[rank].append(own / reference)
        return self.current()

    def current(self) -> list[Straggler]:
        found = []
        for rank, ratios in enumerate(self._ratios):
            if len(ratios) < self.window:
                continue
            ratio = statistics.median(ratios)
            if ratio > 1 + self.threshold:
                group = self.groups.group_of_rank[rank]
                found.append(Straggler(rank, group, round(ratio, 3), self.window))
        return found


class StragglerNotices:
    """Tells the agent when the set of named stragglers changes: rank 0 speaks for the run (every
    rank runs the detector on the same exchanged times, so every rank reaches the same set)."""

    def __init__(self, channel: ReportChannel, detector: StragglerDetector, *, speaks: bool):
        self.channel = channel
        self.detector = detector
        self.speaks = speaks
        self.named: set[int] = set()

    def observe(self, step: int, compute_s: Sequence[float]) -> list[Straggler] | None:
        """The stragglers after this step's times, when the set changed (else None)."""
        stragglers = self.detector.observe(compute_s)
        ranks = {s.rank for s in stragglers}
        if ranks == self.named:
            return None
        self.named = ranks
        if self.speaks:
            for s in stragglers:
                self.channel.send("straggler", step=step, straggler_rank=s.rank, group=s.group,
                                  ratio=s.ratio, window=s.window)  # fmt: skip
        return stragglers
