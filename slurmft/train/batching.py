"""A constant global batch at any world size, through gradient accumulation.

global_batch = world_size x micro_batch x accumulation_steps, exactly. When a restart changes the
world size, the micro batch and the number of accumulation steps change; the global batch (and so
the optimisation) does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurmft.errors import SlurmftError


class BatchPlanError(SlurmftError):
    """The global batch cannot be split evenly over this world size."""


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    world_size: int
    micro_batch: int
    accumulation_steps: int

    @property
    def per_rank_per_step(self) -> int:
        return self.micro_batch * self.accumulation_steps


def plan_batches(global_batch: int, world_size: int, max_micro_batch: int) -> BatchPlan:
    """The fewest accumulation steps whose micro batch fits `max_micro_batch`."""
    if global_batch <= 0 or world_size <= 0 or max_micro_batch <= 0:
        raise BatchPlanError("global batch, world size and micro batch must be positive")
    if global_batch % world_size:
        raise BatchPlanError(
            f"the global batch {global_batch} cannot be split evenly over {world_size} ranks; "
            f"run with a world size that divides it, or change the global batch (which changes "
            f"the training and is refused on resume unless allowed)"
        )
    per_rank = global_batch // world_size
    for accumulation in range(1, per_rank + 1):
        if per_rank % accumulation == 0 and per_rank // accumulation <= max_micro_batch:
            return BatchPlan(global_batch, world_size, per_rank // accumulation, accumulation)
    raise AssertionError("unreachable: accumulation == per_rank gives micro batch 1")
