"""The suite's one bounded wait (tests/support/waiting.py)."""

from __future__ import annotations

import itertools

import pytest
from support.waiting import WaitTimeout, wait_for, wait_for_value


def test_returns_the_first_truthy_answer() -> None:
    answers = iter([None, [], ["job 14"]])
    assert wait_for(lambda: next(answers), 5, "a job", interval_s=0.001) == ["job 14"]


def test_a_timeout_names_what_it_waited_for_as_it_was_then() -> None:
    calls = itertools.count()
    with pytest.raises(
        WaitTimeout, match=r"timed out after 0.05 s waiting for n4 idle \(asked \d+"
    ) as info:
        wait_for(
            lambda: next(calls) < 0, 0.05, lambda: f"n4 idle (asked {next(calls)})", interval_s=0.01
        )
    assert isinstance(info.value, AssertionError)  # pytest reports it as a failure


def test_wait_for_value_returns_a_falsy_value_and_the_time_taken() -> None:
    alive = iter([True, True, False])
    value, seconds = wait_for_value(
        "the worker gone", lambda: next(alive), lambda a: not a, 5, interval_s=0.001
    )
    assert value is False and 0 <= seconds < 5


def test_wait_for_value_shows_the_last_value_seen() -> None:
    with pytest.raises(WaitTimeout, match=r"waiting for job 14 RUNNING; last: 'PENDING'"):
        wait_for_value("job 14 RUNNING", lambda: "PENDING", "RUNNING".__eq__, 0.02, interval_s=0.01)
