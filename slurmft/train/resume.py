"""The resume check: a restart may change the world size, never the training.

The manifest of every checkpoint records the global batch and the learning-rate schedule the run
trained with. On resume they are compared with the restarted run's; a difference is refused with a
message that says what changed and how to proceed, unless the script explicitly allows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurmft.errors import SlurmftError


class ResumeRefused(SlurmftError):
    """Resuming would silently change the training (global batch, LR schedule, sample order)."""


@dataclass(frozen=True)
class TrainingContract:
    """What must not change across restarts. `lr_schedule` is a JSON-able description the script
    chooses (e.g. {"kind": "cosine", "lr": 0.1, "warmup": 100, "total_steps": 10000})."""

    global_batch: int
    lr_schedule: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "lr_schedule": dict(self.lr_schedule)}


def check_resume(
    saved: Mapping[str, Any],
    current: TrainingContract,
    *,
    checkpoint: str,
    allow_global_batch_change: bool = False,
    allow_lr_schedule_change: bool = False,
) -> list[str]:
    """Raise ResumeRefused on a forbidden change; return notes about allowed changes."""
    notes: list[str] = []
    old_batch = int(saved["global_batch"])
    if old_batch != current.global_batch:
        change = f"the global batch would change from {old_batch} to {current.global_batch}"
        if not allow_global_batch_change:
            raise ResumeRefused(
                f"refusing to resume from {checkpoint}: {change}. Keep the global batch at "
                f"{old_batch} (gradient accumulation keeps it constant at any world size that "
                f"divides it), or allow the change explicitly (allow_global_batch_change)."
            )
        notes.append(f"allowed: {change}")
    old_schedule = dict(saved["lr_schedule"])
    if old_schedule != dict(current.lr_schedule):
        change = f"the LR schedule would change from {old_schedule} to {dict(current.lr_schedule)}"
        if not allow_lr_schedule_change:
            raise ResumeRefused(
                f"refusing to resume from {checkpoint}: {change}. Restart with the same schedule, "
                f"or allow the change explicitly (allow_lr_schedule_change)."
            )
        notes.append(f"allowed: {change}")
    return notes
