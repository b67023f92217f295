from __future__ import annotations

import pytest

from slurmft.train.batching import BatchPlan, BatchPlanError, plan_batches


@pytest.mark.parametrize(
    ("global_batch", "world", "max_micro", "micro", "accumulation"),
    [
        (12, 3, 4, 4, 1),
        (12, 2, 4, 3, 2),
        (12, 1, 4, 4, 3),
        (12, 4, 4, 3, 1),
        (12, 6, 1, 1, 2),
        (64, 8, 3, 2, 4),
        (7, 7, 1, 1, 1),
    ],
)
def test_the_global_batch_stays_constant(
    global_batch: int, world: int, max_micro: int, micro: int, accumulation: int
) -> None:
    plan = plan_batches(global_batch, world, max_micro)
    assert plan == BatchPlan(global_batch, world, micro, accumulation)
    assert plan.world_size * plan.micro_batch * plan.accumulation_steps == global_batch
    assert plan.micro_batch <= max_micro


def test_a_world_size_that_does_not_divide_the_global_batch_is_an_error() -> None:
    with pytest.raises(BatchPlanError, match="cannot be split evenly over 5 ranks"):
        plan_batches(12, 5, 4)
