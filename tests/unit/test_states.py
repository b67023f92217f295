from __future__ import annotations

import pytest

from slurmft.db.models import Attempt, Run
from slurmft.db.states import (
    ATTEMPT_TRANSITIONS,
    RUN_TRANSITIONS,
    AttemptState,
    IllegalTransition,
    RunState,
    check_transition,
)


def _run(state: RunState = RunState.PENDING) -> Run:
    return Run(name="r", owner_uid=1000, owner_name="alice", nodes=2, command=["x"], state=state)


def test_every_state_has_a_row_in_its_table() -> None:
    assert set(RUN_TRANSITIONS) == set(RunState)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptState)


def test_terminal_states_allow_nothing() -> None:
    for state in RunState:
        assert state.is_terminal == (not RUN_TRANSITIONS[state])
    for attempt_state in AttemptState:
        assert attempt_state.is_terminal == (not ATTEMPT_TRANSITIONS[attempt_state])


def test_a_run_walks_through_recovery() -> None:
    run = _run()
    for state in (RunState.RUNNING, RunState.RECOVERING, RunState.RUNNING, RunState.COMPLETED):
        run.state = state
    assert run.state is RunState.COMPLETED


@pytest.mark.parametrize(
    ("start", "illegal"),
    [
        (RunState.COMPLETED, RunState.RUNNING),
        (RunState.STOPPED, RunState.RECOVERING),
        (RunState.PENDING, RunState.RECOVERING),
        (RunState.CANCELLED, RunState.PENDING),
    ],
)
def test_illegal_run_transition_raises(start: RunState, illegal: RunState) -> None:
    run = _run(start)
    with pytest.raises(IllegalTransition, match=f"from {start.value} to {illegal.value}"):
        run.state = illegal
    assert run.state is start


def test_illegal_attempt_transition_raises() -> None:
    attempt = Attempt(number=1, state=AttemptState.SUBMITTED)
    attempt.state = AttemptState.RUNNING
    attempt.state = AttemptState.REQUEUED
    with pytest.raises(IllegalTransition, match="terminal"):
        attempt.state = AttemptState.RUNNING


def test_state_strings_are_accepted_and_normalised() -> None:
    run = _run()
    run.state = "running"  # type: ignore[assignment]
    assert run.state is RunState.RUNNING
    with pytest.raises(ValueError):
        run.state = "exploded"  # type: ignore[assignment]


def test_same_state_is_not_a_transition() -> None:
    check_transition(RunState.COMPLETED, RunState.COMPLETED, RUN_TRANSITIONS)
