"""The crash-loop budget: when to stop restarting a run.

One pure rule, shared by the controller daemon and the batch step (which enforces it alone while
the daemon is away), so the two never disagree:

- every restart is charged to a failure class;
- a restart whose cause was a node that was then removed from the run is free (a week-long run
  that survives twenty independent node failures is a success, not a crash loop);
- time limits and preemption are expected ends, free as well;
- progress (a newer verified checkpoint, or for a plain script a newer file under its declared
  checkpoint path) resets the count;
- after ``max_restarts_without_progress`` charged restarts in a row without progress (the
  count ``restarts_without_progress``), the next failure stops the run instead of restarting it.

Use: on each failure, ``budget = budget.charge(restart)``; restart if not ``budget.exhausted``,
else stop with ``budget.stop_reason()``.

One type, `RestartBudget`, and one format (`RestartBudget.to_dict`): the batch step keeps it in
its state file in the checkpoint directory across requeues; the daemon keeps the same count in
the store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from slurmft.core.defaults import MAX_RESTARTS_WITHOUT_PROGRESS
from slurmft.core.kinds import FaultClass

FREE_CLASSES = frozenset({FaultClass.PREEMPTION, FaultClass.TIME_LIMIT})


@dataclass(frozen=True)
class Restart:
    """One restart of the run's workers, as the budget sees it."""

    cause: FaultClass
    node_removed: bool = False  # the node blamed for it left the run (spare, eviction, exclude)
    progress: str | None = None  # newest verified checkpoint id seen before this restart


@dataclass(frozen=True)
class RestartBudget:
    """The run's restart budget: the one count (``restarts_without_progress``, charged
    restarts in a row since the last progress), its cap (``max_restarts_without_progress``, the
    setting of that name) and the one rule that says stop (`exhausted`).

    The daemon keeps the count in the store (``runs.restarts_without_progress``), the batch step
    in its state file (`to_dict`, the one format); both charge it with `charge`."""

    max_restarts_without_progress: int = MAX_RESTARTS_WITHOUT_PROGRESS
    restarts_without_progress: int = 0
    last_progress: str | None = None  # the newest progress seen (`progress_label`)
    restarts_by_class: Mapping[str, int] = field(default_factory=dict)

    @property
    def exhausted(self) -> bool:
        """Stop: more charged restarts in a row than the cap allows."""
        return self.restarts_without_progress > self.max_restarts_without_progress

    @property
    def remaining(self) -> int:
        return max(0, self.max_restarts_without_progress - self.restarts_without_progress)

    def is_free(self, restart: Restart) -> bool:
        return restart.cause in FREE_CLASSES or restart.node_removed

    def charge(self, restart: Restart) -> RestartBudget:
        """The budget after ``restart``; progress since the last restart resets the count."""
        by_class = dict(self.restarts_by_class)
        by_class[restart.cause.value] = by_class.get(restart.cause.value, 0) + 1
        progressed = restart.progress is not None and restart.progress != self.last_progress
        in_a_row = 0 if progressed else self.restarts_without_progress
        if not self.is_free(restart):
            in_a_row += 1
        return replace(
            self,
            restarts_without_progress=in_a_row,
            last_progress=restart.progress if progressed else self.last_progress,
            restarts_by_class=by_class,
        )

    def stop_reason(self) -> str:
        cap = self.max_restarts_without_progress
        if not self.exhausted:
            # The batch step gave up on its own count (agent steps that ended), which the
            # daemon does not see: say what the cap means, not this budget's smaller count.
            return (
                f"crash loop: more than {cap} restarts in a row without a newer verified "
                f"checkpoint; the cap is {cap} (policy.max_restarts_without_progress)"
            )
        # The count when the budget was spent: cap restarts, then one more. A restart that
        # came while the stop was on its way (warm workers restart within a second) is said
        # after, not in place of it.
        later = self.restarts_without_progress - 1 - cap
        return (
            f"crash loop: {cap} restarts in a row without progress (no newer verified "
            f"checkpoint than {self.last_progress or 'none'}), then another failure; the cap is "
            f"{cap} (policy.max_restarts_without_progress)"
            + (f"; {later} more before the stop took effect" if later > 0 else "")
        )

    def to_dict(self) -> dict[str, Any]:
        """The budget as JSON fields: the batch step's state file holds exactly these."""
        return {
            "max_restarts_without_progress": self.max_restarts_without_progress,
            "restarts_without_progress": self.restarts_without_progress,
            "last_progress": self.last_progress,
            "restarts_by_class": dict(sorted(self.restarts_by_class.items())),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, cap: int | None = None) -> RestartBudget:
        """`to_dict`'s fields, or a state file of slurmft 0.1's batch step (its count under the
        same name, its progress under ``last_checkpoint``, no cap); ``cap`` overrides the
        recorded cap (the batch step's is the one its job was started with)."""
        progress = data.get("last_progress", data.get("last_checkpoint")) or None
        recorded_cap = data.get("max_restarts_without_progress")
        return cls(
            max_restarts_without_progress=int(
                cap if cap is not None else recorded_cap or MAX_RESTARTS_WITHOUT_PROGRESS
            ),
            restarts_without_progress=int(data.get("restarts_without_progress", 0)),
            last_progress=str(progress) if progress is not None else None,
            restarts_by_class={
                str(k): int(v) for k, v in (data.get("restarts_by_class") or {}).items()
            },
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RestartBudget:
        return cls.from_dict(json.loads(text))


# --- the daemon's view: restarts read from what the agents reported ---------------------------
#
# torchrun restarts workers in place (a crashed rank, a hang the daemon ended) without the agent
# step ending, so the batch step never sees those restarts. The daemon does, from two reports:
# the surviving ranks' collective errors when a rank dies (within a second), and every agent's
# "workers restarted" once torchrun's next rendezvous round completes. One failure is reported
# by many ranks and agents, so reports are grouped into one restart each.
#
# Exactly, by rendezvous round: every restart is a new round of torchrun's rendezvous, so each
# report names the round it ended (`Sighting.round`: the round a failing worker ran in, the
# round an agent's torchrun left), and all reports naming one round are one restart.
#
# By time, for reports without a round (torch internals the launcher could not read, see
# slurmft.agent.rounds): a new group starts when a reporter of the current group reports the
# same thing again (its next failure), when a collective error comes after workers of the group
# restarted already, or when the group is older than ``GROUP_S``. This can merge two quick
# failures whose reports came from different ranks, so rounds are preferred wherever known.
#
# Either way a group counts from its first report, so a run over budget is stopped while
# torchrun is still restarting it, not after.

GROUP_S = 60.0  # a restart under load may take a minute; a new failure repeats a reporter first
CAUSE_WINDOW_S = 60.0  # a node loss this close to a restart caused it (Slurm DOWN takes ~10 s)


class Seen(StrEnum):
    """What the store holds that the run's budget is read from."""

    FAILURE = "failure"  # a rank saw a peer fail (a collective error)
    RESTART = "restart"  # an agent's workers restarted
    CHECKPOINT = "checkpoint"  # a verified checkpoint (with its step)
    NODE_REMOVED = "node_removed"  # a node lost, or taken out of the run
    HANG = "hang"  # hung workers were killed
    NUMERICAL = "numerical"  # a rank's non-finite loss, reproduced on re-run
    JOB_FAILED = "job_failed"  # an earlier job of the run failed and was resubmitted


# What restart_groups groups into failures; the rest is evidence about them.
FAILURE_REPORTS = frozenset({Seen.FAILURE, Seen.RESTART})


@dataclass(frozen=True)
class Sighting:
    kind: Seen
    at: datetime
    agent: str = ""  # FAILURE, RESTART: the reporting agent
    rank: int = -1  # FAILURE: the reporting rank (an agent may hold several)
    round: str = ""  # FAILURE, RESTART: the rendezvous round it ended, when known (round_key)
    step: int = -1  # CHECKPOINT: the global step it holds (for a file, its place in time)
    label: str = ""  # CHECKPOINT: how it reads as progress, when not `progress_label(step)`


@dataclass(frozen=True)
class _Group:
    at: datetime
    reporters: frozenset[tuple[Seen, str, int]]

    @property
    def restarted(self) -> bool:
        """Workers came back already: an error reported now is about the next failure."""
        return any(kind is Seen.RESTART for kind, _, _ in self.reporters)


def round_key(agent_step: str, ended_round: int) -> str:
    """A rendezvous round, named uniquely in the run: round numbers count within the store of
    one agent step (``agent_step``: the batch step's launch, "<job>.<launch>")."""
    return f"{agent_step}/{ended_round}"


def named_round(details: object) -> str:
    """The round an event's details name (``rdzv_round``, a `round_key`), or "" when none."""
    named = details.get("rdzv_round") if isinstance(details, dict) else None
    return named if isinstance(named, str) else ""


def restart_groups(sightings: Sequence[Sighting], group_s: float = GROUP_S) -> list[datetime]:
    """When each failure of the run that torchrun restarts in place was first reported: one
    per rendezvous round ended, and the reports without a round grouped by time. An agent that
    named rounds has its reports without one left out: they are the same restarts, seen
    through its workers' heartbeats."""
    return [at for at, _ in _named_groups(sightings, group_s)]


def _named_groups(sightings: Sequence[Sighting], group_s: float) -> list[tuple[datetime, str]]:
    """`restart_groups` with a name for each: the round's key, or the first report's time."""
    reports = [s for s in sightings if s.kind in FAILURE_REPORTS]
    first_by_round: dict[str, datetime] = {}
    for s in reports:
        if s.round and (s.round not in first_by_round or s.at < first_by_round[s.round]):
            first_by_round[s.round] = s.at
    naming = {s.agent for s in reports if s.round}
    unnamed = [s for s in reports if not s.round and s.agent not in naming]
    by_time = [(at, f"reported {at.isoformat()}") for at in _groups_by_time(unnamed, group_s)]
    return sorted([*((at, key) for key, at in first_by_round.items()), *by_time])


def _groups_by_time(reports: Sequence[Sighting], group_s: float) -> list[datetime]:
    groups: list[_Group] = []
    for s in sorted(reports, key=lambda s: s.at):
        reporter = (s.kind, s.agent, s.rank if s.kind is Seen.FAILURE else -1)
        current = groups[-1] if groups else None
        if (
            current is None
            or reporter in current.reporters
            or (s.kind is Seen.FAILURE and current.restarted)
            or (s.at - current.at).total_seconds() > group_s
        ):
            groups.append(_Group(s.at, frozenset({reporter})))
        else:
            groups[-1] = _Group(current.at, current.reporters | {reporter})
    return [g.at for g in groups]


def progress_label(step: int) -> str:
    """How a checkpoint's step reads as the budget's progress (`RestartBudget.last_progress`)."""
    return f"step {step}"


@dataclass(frozen=True)
class ChargedRestart:
    """One restart as the budget sees it: first reported at ``at``, its cause, and a key that
    names it the same way on every pass (the round it ended, or its first report)."""

    at: datetime
    cause: FaultClass
    node_removed: bool
    key: str


def charged_restarts(
    sightings: Sequence[Sighting],
    *,
    group_s: float = GROUP_S,
    cause_window_s: float = CAUSE_WINDOW_S,
) -> list[ChargedRestart]:
    """Every restart in the sightings, in time order, with its cause: in-place restarts (a
    node removed near it, a hang killed just before it, a numerical fault reproduced just
    before it, else the user's code) and earlier failed jobs (the user's code)."""
    window = timedelta(seconds=cause_window_s)
    removed = [s.at for s in sightings if s.kind is Seen.NODE_REMOVED]
    hangs = [s.at for s in sightings if s.kind is Seen.HANG]
    numerical = [s.at for s in sightings if s.kind is Seen.NUMERICAL]
    restarts: list[ChargedRestart] = []
    for at, key in _named_groups(sightings, group_s):
        if any(abs(at - r) <= window for r in removed):
            restarts.append(ChargedRestart(at, FaultClass.HARDWARE, True, key))
        elif any(timedelta(0) <= at - h <= window for h in hangs):
            restarts.append(ChargedRestart(at, FaultClass.HANG, False, key))
        elif any(timedelta(0) <= at - n <= window for n in numerical):
            restarts.append(ChargedRestart(at, FaultClass.NUMERICAL, False, key))
        else:
            restarts.append(ChargedRestart(at, FaultClass.USER_CODE, False, key))
    restarts += [
        ChargedRestart(s.at, FaultClass.USER_CODE, False, f"job failed {s.at.isoformat()}")
        for s in sightings
        if s.kind is Seen.JOB_FAILED
    ]
    return sorted(restarts, key=lambda r: r.at)


def budget_from_history(
    sightings: Sequence[Sighting],
    max_restarts_without_progress: int,
    *,
    group_s: float = GROUP_S,
    cause_window_s: float = CAUSE_WINDOW_S,
    start: RestartBudget | None = None,
) -> RestartBudget:
    """The run's budget after everything it went through, in time order: the restarts
    (`charged_restarts`), and checkpoints as progress. ``start``: what was charged before
    these sightings (the batch step's count from earlier agent steps and requeues)."""
    budget = start or RestartBudget(max_restarts_without_progress=max_restarts_without_progress)
    charged = list(_budget_after_each(sightings, budget, group_s, cause_window_s))
    return charged[-1][1] if charged else budget


def spent_at(
    sightings: Sequence[Sighting],
    max_restarts_without_progress: int,
    *,
    group_s: float = GROUP_S,
    cause_window_s: float = CAUSE_WINDOW_S,
) -> datetime | None:
    """When `budget_from_history` first read the budget spent: the first report of the restart
    that took the count past the cap (None: not spent)."""
    budget = RestartBudget(max_restarts_without_progress=max_restarts_without_progress)
    charged = _budget_after_each(sightings, budget, group_s, cause_window_s)
    return next((at for at, after in charged if after.exhausted), None)


def _budget_after_each(
    sightings: Sequence[Sighting], budget: RestartBudget, group_s: float, cause_window_s: float
) -> Iterator[tuple[datetime, RestartBudget]]:
    """Each restart's first report, with the budget after it is charged, in time order."""
    checkpoints = sorted((s.at, s.step, s.label) for s in sightings if s.kind is Seen.CHECKPOINT)
    restarts = charged_restarts(sightings, group_s=group_s, cause_window_s=cause_window_s)
    for restart in restarts:
        held = [(step, label) for when, step, label in checkpoints if when <= restart.at]
        newest = max(held) if held else None
        progress = (newest[1] or progress_label(newest[0])) if newest else None
        budget = budget.charge(
            Restart(restart.cause, node_removed=restart.node_removed, progress=progress)
        )
        yield restart.at, budget
