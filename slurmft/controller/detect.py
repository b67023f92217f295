"""Pure detectors: hangs, frozen ranks, a silent channel, stragglers.

Inputs are plain observations, outputs are findings; no clock, no I/O. The rules come from what
was measured here (notes/torchrun.md):

- A rank whose heartbeats still arrive but say it has made no progress past its phase's deadline
  is hung in that phase (a collective that never returns). A long checkpoint is in the
  checkpoint phase with its own, longer deadline: not a hang.
- A rank whose heartbeats stopped while its peers' still arrive is frozen (SIGSTOP, D state).
- Every rank of a run silent at once is the report channel (agent, network, daemon), not every
  rank hanging: it is reported as such and never triggers a restart.
- A run whose script never imports slurmft.train sends no heartbeats at all: no findings.
- A node whose agent stopped reporting (agents report at least every few seconds, idle ones
  with an empty keep-alive) while the agents on other nodes still report is unresponsive as a
  whole: its agent froze with its workers, or the node's OS did, though its slurmd may still
  answer Slurm. Every agent silent together is the channel again, never a node.
- Step time alone cannot name a straggler (everyone waits for the slowest in the all-reduce);
  each rank's *own compute time* can. A rank is a straggler when its compute time exceeds the
  median of the other ranks in its peer group by more than the threshold in every bucket of the
  window, so one noisy step never flags anyone.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import NamedTuple


class HangKind(StrEnum):
    OVERDUE = "overdue"  # heartbeats arrive, no progress past the phase deadline
    FROZEN = "frozen"  # heartbeats stopped while peers' continue


class RankBeat(NamedTuple):
    """The latest heartbeat of one rank, as the daemon holds it (a NamedTuple, not a frozen
    dataclass: one is built per rank per pass, and that init costs five times as much)."""

    rank: int
    node: str
    phase: str
    step: int
    received_at: datetime
    progress_age_s: float
    deadline_s: float


@dataclass(frozen=True)
class HangFinding:
    rank: int
    node: str
    phase: str
    kind: HangKind
    seconds: float  # without progress (overdue) or without heartbeats (frozen)
    deadline_s: float
    step: int = -1  # the step it was last heard at

    @property
    def reason(self) -> str:
        if self.kind is HangKind.OVERDUE:
            return (
                f"slurmft: hang rank {self.rank} no progress in {self.phase} for "
                f"{self.seconds:.0f}s (deadline {self.deadline_s:.0f}s)"
            )
        return f"slurmft: hang rank {self.rank} silent for {self.seconds:.0f}s while peers report"


@dataclass(frozen=True)
class Silence:
    """Every rank of the run went quiet together: a channel problem, not a hang."""

    ranks: int
    seconds: float


def find_hangs(
    beats: Sequence[RankBeat], *, now: datetime, silent_after_s: float
) -> tuple[list[HangFinding], Silence | None]:
    """Hung and frozen ranks of one run, or the run's silence as a whole."""
    beats = [b for b in beats if b.phase != "done"]  # stopped reporting on purpose
    if not beats:
        return [], None  # a plain torchrun script: node-level supervision only
    ages = {b.rank: (now - b.received_at).total_seconds() for b in beats}
    fresh = [b for b in beats if ages[b.rank] <= silent_after_s]
    if not fresh:
        return [], Silence(ranks=len(beats), seconds=min(ages.values()))
    findings = [
        HangFinding(
            b.rank, b.node, b.phase, HangKind.OVERDUE, b.progress_age_s, b.deadline_s, b.step
        )
        for b in fresh
        if b.progress_age_s > b.deadline_s
    ]
    findings += [
        HangFinding(b.rank, b.node, b.phase, HangKind.FROZEN, ages[b.rank], silent_after_s, b.step)
        for b in beats
        if ages[b.rank] > silent_after_s
    ]
    return sorted(findings, key=lambda f: f.rank), None


@dataclass(frozen=True)
class UnresponsiveNode:
    node: str
    seconds: float  # since its agent last reported

    @property
    def reason(self) -> str:
        return (
            f"slurmft: node {self.node} unresponsive: its agent silent for {self.seconds:.0f}s "
            f"while its peers report"
        )


def find_unresponsive(
    last_report_at: Mapping[str, datetime], *, now: datetime, silent_after_s: float
) -> list[UnresponsiveNode]:
    """Nodes whose agent has not reported for longer than ``silent_after_s`` while an agent on
    another node reported within it. A node never heard from is not judged (its agent may not
    have started yet), and the run silent as a whole is the report channel: no findings."""
    ages = {node: (now - at).total_seconds() for node, at in last_report_at.items()}
    reporting = {node for node, age in ages.items() if age <= silent_after_s}
    return [
        UnresponsiveNode(node, age)
        for node, age in sorted(ages.items())
        if age > silent_after_s and reporting
    ]


class RankCompute(NamedTuple):
    """One rank's own compute time per bucket of the window (e.g. per-minute medians), oldest
    first; buckets are aligned across the ranks of a run. One per rank per pass: a NamedTuple."""

    rank: int
    node: str
    buckets: tuple[float, ...]
    peer_group: str = ""  # pipeline stages differ by design: compare within a group only


@dataclass(frozen=True)
class StragglerFinding:
    rank: int
    node: str
    margin: float  # mean fraction over the group median across the window, e.g. 0.31
    buckets: int

    @property
    def reason(self) -> str:
        return f"slurmft: straggler rank {self.rank} +{self.margin * 100:.0f}% over median"


def find_stragglers(
    ranks: Sequence[RankCompute], *, threshold: float, window_buckets: int
) -> list[StragglerFinding]:
    """Ranks slower than their peer group's median by more than ``threshold`` in every one of
    the last ``window_buckets`` buckets."""
    groups: dict[str, list[RankCompute]] = defaultdict(list)
    for rc in ranks:
        groups[rc.peer_group].append(rc)
    findings: list[StragglerFinding] = []
    for members in groups.values():
        if len(members) < 2 or any(len(m.buckets) < window_buckets for m in members):
            continue  # nobody to compare with, or not a whole window yet
        findings += _stragglers_in_group(members, threshold, window_buckets)
    return sorted(findings, key=lambda f: f.rank)


def _stragglers_in_group(
    members: list[RankCompute], threshold: float, window_buckets: int
) -> list[StragglerFinding]:
    findings = []
    # Each bucket sorted once, so the median of the others is read off per rank in O(log n)
    # (building every rank's list of the others was quadratic: minutes for 16k ranks).
    window = range(-window_buckets, 0)
    ordered = {i: sorted(m.buckets[i] for m in members) for i in window}
    for member in members:
        ratios = []
        for i in window:
            # The median of the *other* ranks: with two ranks the slow one still stands out.
            median = _median_without(ordered[i], member.buckets[i])
            ratios.append(member.buckets[i] / median - 1.0 if median > 0 else 0.0)
        if all(r > threshold for r in ratios):
            findings.append(
                StragglerFinding(member.rank, member.node, statistics.fmean(ratios), window_buckets)
            )
    return findings


def _median_without(ordered: list[float], value: float) -> float:
    """``statistics.median`` of the sorted ``ordered`` with one ``value`` taken out (taking out
    any element equal to it leaves the same list)."""
    gone = bisect.bisect_left(ordered, value)
    size = len(ordered) - 1

    def at(index: int) -> float:
        return ordered[index if index < gone else index + 1]

    if size % 2:
        return at(size // 2)
    return (at(size // 2 - 1) + at(size // 2)) / 2
