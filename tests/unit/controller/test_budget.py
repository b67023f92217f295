from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from slurmft.core.budget import (
    Restart,
    RestartBudget,
    Seen,
    Sighting,
    budget_from_history,
    restart_groups,
    round_key,
    spent_at,
)
from slurmft.db.models import FaultClass

HW, CODE, HANG, TIME = (
    FaultClass.HARDWARE,
    FaultClass.USER_CODE,
    FaultClass.HANG,
    FaultClass.TIME_LIMIT,
)


def _apply(restarts: list[Restart], cap: int = 5) -> tuple[RestartBudget, int | None]:
    """The budget after the restarts, and the index of the failure that stopped the run."""
    budget = RestartBudget(max_restarts_without_progress=cap)
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


# --- the daemon reads the budget from what the agents reported --------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _restart(seconds: float, *agents: str) -> list[Sighting]:
    """One rendezvous round: every agent taking part reports its workers back within a second."""
    return [Sighting(Seen.RESTART, _at(seconds + i * 0.3), agent=a) for i, a in enumerate(agents)]


def _checkpoint(seconds: float, step: int) -> Sighting:
    return Sighting(Seen.CHECKPOINT, _at(seconds), step=step)


def test_one_restart_reported_by_every_agent_is_one_restart() -> None:
    history = _restart(0, "a", "b", "c") + _restart(15, "a", "b", "c") + _restart(18, "d")
    assert restart_groups(history) == [_at(0), _at(15)]  # d joined the second round late
    assert restart_groups([*history, *_restart(80, "e")]) == [_at(0), _at(15), _at(80)]
    # An agent that reports again began the next restart, however soon.
    assert restart_groups(_restart(0, "a", "b") + _restart(2, "a")) == [_at(0), _at(2)]


def _failure(seconds: float, *ranks: tuple[str, int]) -> list[Sighting]:
    """The surviving ranks' collective errors when a peer died."""
    return [Sighting(Seen.FAILURE, _at(seconds), agent=a, rank=r) for a, r in ranks]


def test_a_failure_is_counted_when_the_survivors_see_it_not_when_the_restart_ends() -> None:
    # Two ranks on agent b: each reports the collective error once; the restart, 30 s later
    # under load, is the same failure.
    one = _failure(0, ("a", 0), ("b", 1), ("b", 2)) + _restart(30, "a", "b", "c")
    assert restart_groups(one) == [_at(0)]
    # An error after the workers came back is the next failure, whoever reports it.
    assert restart_groups([*one, *_failure(40, ("c", 1))]) == [_at(0), _at(40)]


def test_rounds_count_each_failure_once_where_time_alone_merges_two() -> None:
    """As seen in a crash loop on a loaded machine: a round whose survivors were stopped before
    they reported their error, and restarts reported seconds late, by the agents that happened
    to count them."""

    def ended(round_: int, reports: list[Sighting]) -> list[Sighting]:
        return [dataclasses.replace(s, round=round_key("7.1", round_)) for s in reports]

    rounds = [
        _failure(1, ("a", 0), ("c", 2)) + _restart(4.6, "b", "a"),
        _failure(6.6, ("a", 0), ("c", 2)) + _restart(9.9, "a", "c"),
        _restart(15.5, "d"),  # no error reported: the survivors were stopped first
        _failure(18, ("a", 0), ("c", 2)) + _restart(21, "b"),
    ]
    by_time = [s for reports in rounds for s in reports]
    assert len(restart_groups(by_time)) == 3  # the third failure merged into the second
    named = [s for n, reports in enumerate(rounds) for s in ended(n, reports)]
    four = [_at(1), _at(6.6), _at(15.5), _at(18)]
    assert restart_groups(named) == four
    # A round reported again later (a spare back from sitting one out names the round it left)
    # is the restart counted already.
    assert restart_groups([*named, *ended(2, _restart(40, "d"))]) == four
    # An agent that names rounds: its unnamed reports are the same restarts. One that names
    # none (a launcher that could not read them) is grouped by time.
    assert restart_groups([*named, *_restart(22, "a"), *_restart(50, "z")]) == [*four, _at(50)]


def test_a_script_that_always_crashes_stops_after_the_cap() -> None:
    history = [_checkpoint(-30, 5)]
    for i in range(6):
        history += _restart(20 * i, "a", "b", "c")
    budget = budget_from_history(history[:-3], 5)  # five restarts: not yet
    assert (budget.restarts_without_progress, budget.exhausted) == (5, False)
    budget = budget_from_history(history, 5)
    assert budget.exhausted and budget.restarts_by_class == {"user_code": 6}
    assert "5 restarts in a row without progress" in budget.stop_reason()
    # Spent by the sixth restart, first reported at 100 s: later ones do not move that.
    assert spent_at(history[:-3], 5) is None
    assert spent_at(history, 5) == spent_at([*history, *_restart(120, "a")], 5) == _at(100)
    # Nor the reason: a restart that came while the stop was on its way is said after it.
    later = budget_from_history([*history, *_restart(120, "a", "b", "c")], 5)
    assert later.restarts_without_progress == 7
    assert later.stop_reason().startswith("crash loop: 5 restarts in a row without progress")
    assert later.stop_reason().endswith("; 1 more before the stop took effect")
    assert "more before" not in budget.stop_reason()


def test_node_losses_near_a_restart_are_free_and_progress_resets() -> None:
    history: list[Sighting] = []
    for i in range(6):  # a loss every minute and a half, restarts a few seconds after it
        history += [
            Sighting(Seen.NODE_REMOVED, _at(90 * i + 12)),
            *_restart(90 * i + 6, "a", "b"),
            _checkpoint(90 * i + 40, 10 * (i + 1)),
        ]
    budget = budget_from_history(history, 5)
    assert (budget.restarts_without_progress, budget.exhausted) == (0, False)
    assert budget.restarts_by_class == {"hardware": 6}


def test_a_hang_is_charged_and_failed_jobs_count_with_in_place_restarts() -> None:
    history = [
        Sighting(Seen.HANG, _at(0)),
        *_restart(10, "a", "b"),
        Sighting(Seen.JOB_FAILED, _at(100)),
        *_restart(200, "c", "d"),
    ]
    budget = budget_from_history(history, 2)
    assert budget.restarts_by_class == {"hang": 1, "user_code": 2}
    assert budget.exhausted  # three charged, no checkpoint at all
    # A newer checkpoint between them resets the count; the same step again does not.
    again = budget_from_history([*history, _checkpoint(150, 5)], 2)
    assert again.restarts_without_progress == 1
    same = budget_from_history([*history, _checkpoint(-5, 5), _checkpoint(150, 5)], 2)
    assert same.restarts_without_progress == 3


def test_the_reason_when_the_batch_step_gave_up_on_a_count_the_daemon_did_not_see() -> None:
    reason = RestartBudget(
        max_restarts_without_progress=5, restarts_without_progress=0
    ).stop_reason()
    assert reason.startswith("crash loop: more than 5 restarts in a row without a newer")
    assert "-1" not in reason and "(policy.max_restarts_without_progress)" in reason


def test_a_restart_after_a_reproduced_numerical_fault_is_charged_as_numerical() -> None:
    history = [Sighting(Seen.NUMERICAL, _at(0)), *_restart(5, "a", "b"), *_restart(300, "a")]
    budget = budget_from_history(history, 5)
    assert budget.restarts_by_class == {"numerical": 1, "user_code": 1}
    assert budget.restarts_without_progress == 2  # charged, not free: rerunning meets it again
