"""What each failure cost a run, measured from its steps (docs/design.md, the effective ratio).

For a failure, from the run's step completions (when each step finished, across ranks):

- ``S``: the last step completed before the failure was detected, at ``t(S)``;
- detection: from ``t(S)`` to the first report of the failure;
- queue wait: the time a requeued or resubmitted job waited for Slurm to start it;
- restart: from detection until training is back (the first step after it completes), less
  the queue wait and that first step's own time;
- replay: the steps done again, ``S`` minus the step resumed from, times the median step.

Together they are the true loss: ``t(first completion of a step > S) - t(S) - median step``.

A script that never imports slurmft.train reports no steps: its figures are estimates (marked
so) from what is observable: the failure's report, the ranks' restarts, the checkpoint files the
batch step found (their times, and the cadence they come at) and the job's start
(slurmft.controller.goodput_pass gathers them). Pure: the store's rows in, figures out.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

# Two completions of one step further apart than this are two runs of it (a replay after a
# restart takes at least a rendezvous); closer, they are the ranks of one run of it, whose
# clocks differ by a few milliseconds.
SAME_STEP_S = 1.0
MEDIAN_OF = 50  # completions before the failure the median step is taken over


@dataclass(frozen=True)
class Completion:
    at: datetime
    step: int
    ranks: int = 1  # how many (of the ranks read) ended this run of the step: its world size


@dataclass(frozen=True)
class Lost:
    """One failure's cost, in seconds; ``total`` is their sum."""

    detection_s: float
    restart_s: float
    queue_wait_s: float
    replay_s: float
    last_step: int | None  # S
    resumed_from: int | None  # the step training went on from (S - steps replayed)
    back_at: datetime | None  # when training was back (its first step after the failure)
    estimate: bool  # True: from observable times, not from steps

    @property
    def total_s(self) -> float:
        return self.detection_s + self.restart_s + self.queue_wait_s + self.replay_s


def completions(rows: Iterable[tuple[int, datetime, int]]) -> list[Completion]:
    """Each run of each step, once, at its earliest end across ranks, with how many ranks
    ended it, in time order; ``rows``: (step, ended_at, rank) of any ranks."""
    by_step: dict[int, list[tuple[datetime, int]]] = {}
    for step, at, rank in rows:
        by_step.setdefault(step, []).append((at, rank))
    found = []
    gap = timedelta(seconds=SAME_STEP_S)
    for step, ends in by_step.items():
        ends.sort()
        run = [ends[0]]
        for previous, end in itertools.pairwise(ends):
            if end[0] - previous[0] > gap:
                found.append(Completion(run[0][0], step, len({r for _, r in run})))
                run = []
            run.append(end)
        found.append(Completion(run[0][0], step, len({r for _, r in run})))
    return sorted(found, key=lambda c: (c.at, c.step))


def median_step_s(before: Sequence[Completion]) -> float | None:
    """The median time between consecutive steps over the last completions in ``before``."""
    recent = before[-(MEDIAN_OF + 1) :]
    deltas = [
        (b.at - a.at).total_seconds()
        for a, b in itertools.pairwise(recent)
        if b.step == a.step + 1
    ]
    return statistics.median(deltas) if deltas else None


def measure(
    steps: Sequence[Completion],
    detected_at: datetime,
    queue_wait_s: float = 0.0,
) -> Lost | None:
    """The cost of a failure detected at ``detected_at``; None while training is not back past
    S yet (it is measured again later), or when no step was completed before it."""
    before = [c for c in steps if c.at <= detected_at]
    if not before:
        return None
    last = before[-1]
    # Back means at full world size: as many ranks as ended the steps before (a rank on the
    # lost node may not have reported S itself).
    full = max(c.ranks for c in before[-10:])
    after = [c for c in steps if c.at > detected_at and c.ranks >= full]
    beyond = next((c for c in after if c.step > last.step), None)
    median = median_step_s(before)
    if beyond is None or median is None:
        return None
    first = after[0]
    resumed_from = first.step - 1
    total = max((beyond.at - last.at).total_seconds() - median, 0.0)
    # Each part within what is left of the true loss, so they always add up to it.
    detection = min(max((detected_at - last.at).total_seconds(), 0.0), total)
    replay = min(max(last.step - resumed_from, 0) * median, total - detection)
    queue = min(max(queue_wait_s, 0.0), total - detection - replay)
    restart = total - detection - replay - queue
    return Lost(detection, restart, queue, replay, last.step, resumed_from, first.at, False)


def never_back(steps: Sequence[Completion], detected_at: datetime, ended_at: datetime) -> Lost:
    """A failure the run did not train past before it ended: everything after S is lost."""
    before = [c for c in steps if c.at <= detected_at]
    last_at = before[-1].at if before else detected_at
    total = max((ended_at - last_at).total_seconds(), 0.0)
    detection = min(max((detected_at - last_at).total_seconds(), 0.0), total)
    step = before[-1].step if before else None
    return Lost(detection, total - detection, 0.0, 0.0, step, None, None, not before)


def estimate(
    failed_at: datetime,
    back_at: datetime | None,
    work_since: datetime | None,
    queue_wait_s: float = 0.0,
) -> Lost | None:
    """The cost of a failure of a script that reports no steps: the work since ``work_since``
    (its newest checkpoint file before the failure, or the start of its job) is done again, and
    the time until its ranks were running again (``back_at``: their restart after it, or the
    start of the job that replaced the failed one) is restart. Detection is not observable
    apart: it counts as restart. None while not back yet."""
    if back_at is None:
        return None
    restart = max((back_at - failed_at).total_seconds() - queue_wait_s, 0.0)
    replay = 0.0
    if work_since is not None:
        replay = max((failed_at - work_since).total_seconds(), 0.0)
    return Lost(0.0, restart, max(queue_wait_s, 0.0), replay, None, None, back_at, True)
