from __future__ import annotations

import pytest

from slurmft.controller.budget import Restart, RestartBudget
from slurmft.db.models import FaultClass

HW, CODE, HANG, TIME = (
    FaultClass.HARDWARE,
    FaultClass.USER_CODE,
    FaultClass.HANG,
    FaultClass.TIME_LIMIT,
)


def _apply(restarts: list[Restart], cap: int = 5) -> tuple[RestartBudget, int | None]:
    """The budget after the restarts, and the index of the failure that stopped the run."""
    budget = RestartBudget(max_without_progress=cap)
    for index, restart in enumerate(restarts):
        budget = budget.charge(restart)
        if budget.exhausted:
            return budget, index
    return budget, None


@pytest.mark.parametrize(
    ("name", "restarts", "stopped_at"),
    [
        (
            "script that always crashes: five restarts, the sixth failure stops",
            [Restart(CODE)] * 10,
            5,
        ),
        (
            "six node losses one after another, progress in between, keep going",
            [Restart(HW, node_removed=True, progress=f"ckpt-{i}") for i in range(6)],
            None,
        ),
        ("node losses are free even without progress", [Restart(HW, node_removed=True)] * 20, None),
        (
            "time limits and preemption are expected ends",
            [Restart(TIME)] * 10 + [Restart(FaultClass.PREEMPTION)] * 10,
            None,
        ),
        (
            "progress resets the count",
            [Restart(CODE)] * 4 + [Restart(CODE, progress="c1")] + [Restart(CODE)] * 4,
            None,
        ),
        ("progress only counts when it is newer", [Restart(CODE, progress="c1")] * 7, 5),
        ("a hang on a node that stayed is charged", [Restart(HANG)] * 3 + [Restart(CODE)] * 3, 5),
        ("a hardware fault whose node stayed is charged", [Restart(HW)] * 6, 5),
    ],
)
def test_budget_table(name: str, restarts: list[Restart], stopped_at: int | None) -> None:
    _, index = _apply(restarts)
    assert index == stopped_at, name


def test_counts_per_class_and_reason() -> None:
    budget, index = _apply(
        [Restart(HW, node_removed=True), Restart(CODE), Restart(TIME)] + [Restart(CODE)] * 5
    )
    assert index == 7
    assert budget.restarts_by_class == {"hardware": 1, "user_code": 6, "time_limit": 1}
    assert "5 restarts in a row without progress" in budget.stop_reason()
    assert "policy.max_restarts_without_progress" in budget.stop_reason()


def test_round_trips_through_json_for_the_batch_step() -> None:
    budget, _ = _apply([Restart(CODE, progress="c9"), Restart(HANG)], cap=3)
    again = RestartBudget.from_json(budget.to_json())
    assert again == budget
    assert again.remaining == 1
