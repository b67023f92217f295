"""The crash-loop budget: when to stop restarting a run.

One pure rule, shared by the controller daemon and the batch step (which enforces it alone while
the daemon is away), so the two never disagree:

- every restart is charged to a failure class;
- a restart whose cause was a node that was then removed from the run is free (a week-long run
  that survives twenty independent node failures is a success, not a crash loop);
- time limits and preemption are expected ends, free as well;
- progress (a newer verified checkpoint, or for a plain script a newer file under its declared
  checkpoint path) resets the count;
- after ``max_without_progress`` charged restarts in a row without progress, the next failure
  stops the run instead of restarting it.

Use: on each failure, ``budget = budget.charge(restart)``; restart if not ``budget.exhausted``,
else stop with ``budget.stop_reason()``.

The state is a small JSON document so the batch step can keep it in the checkpoint directory
across requeues; the daemon keeps the same numbers in the store.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from slurmft.db.models import FaultClass

FREE_CLASSES = frozenset({FaultClass.PREEMPTION, FaultClass.TIME_LIMIT})


@dataclass(frozen=True)
class Restart:
    """One restart of the run's workers, as the budget sees it."""

    cause: FaultClass
    node_removed: bool = False  # the node blamed for it left the run (spare, eviction, exclude)
    progress: str | None = None  # newest verified checkpoint id seen before this restart


@dataclass(frozen=True)
class RestartBudget:
    max_without_progress: int = 5
    charged_in_a_row: int = 0
    last_progress: str | None = None
    restarts_by_class: dict[str, int] = field(default_factory=dict)

    @property
    def exhausted(self) -> bool:
        return self.charged_in_a_row > self.max_without_progress

    @property
    def remaining(self) -> int:
        return max(0, self.max_without_progress - self.charged_in_a_row)

    def is_free(self, restart: Restart) -> bool:
        return restart.cause in FREE_CLASSES or restart.node_removed

    def charge(self, restart: Restart) -> RestartBudget:
        """The budget after ``restart``; progress since the last restart resets the count."""
        by_class = dict(self.restarts_by_class)
        by_class[restart.cause.value] = by_class.get(restart.cause.value, 0) + 1
        progressed = restart.progress is not None and restart.progress != self.last_progress
        in_a_row = 0 if progressed else self.charged_in_a_row
        if not self.is_free(restart):
            in_a_row += 1
        return replace(
            self,
            charged_in_a_row=in_a_row,
            last_progress=restart.progress if progressed else self.last_progress,
            restarts_by_class=by_class,
        )

    def stop_reason(self) -> str:
        return (
            f"crash loop: {self.charged_in_a_row - 1} restarts in a row without progress (no "
            f"newer verified checkpoint than {self.last_progress or 'none'}), then another "
            f"failure; the cap is {self.max_without_progress} "
            f"(policy.max_restarts_without_progress)"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RestartBudget:
        data: dict[str, Any] = json.loads(text)
        return cls(
            max_without_progress=int(data["max_without_progress"]),
            charged_in_a_row=int(data["charged_in_a_row"]),
            last_progress=data.get("last_progress"),
            restarts_by_class={
                str(k): int(v) for k, v in data.get("restarts_by_class", {}).items()
            },
        )
