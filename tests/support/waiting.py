"""The one bounded wait of the suite: poll until a condition holds, or fail past a deadline.

Every wait has a deadline and no wait is a fixed sleep; a wait that times out fails the test
with what it waited for (an AssertionError, so pytest reports a failure, not an error).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold before the deadline."""


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    interval_s: float = 0.1,
) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns something truthy, and return that.

    Past ``timeout_s`` raise WaitTimeout naming ``what``. A callable ``what`` is called only
    then, so it can describe the state at the timeout (logs as they are then, not at the call).
    The predicate is always asked at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            described = what() if callable(what) else what
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {described}")
        time.sleep(min(interval_s, left))


def wait_for_value(
    what: str,
    probe: Callable[[], T],
    done: Callable[[T], object],
    timeout_s: float = 30.0,
    *,
    interval_s: float = 0.2,
) -> tuple[T, float]:
    """Poll ``probe()`` until ``done(value)``; return that value and the seconds the wait took.

    For waits on a state that is read, then judged (a job's state, a node's): the value may
    itself be falsy (no jobs left, a process gone), and a timeout shows the last value seen.
    """
    started = time.monotonic()
    seen: list[T] = []

    def settled() -> tuple[T] | None:
        seen[:] = [probe()]
        return (seen[0],) if done(seen[0]) else None

    (value,) = wait_for(
        settled, timeout_s, lambda: f"{what}; last: {seen[0]!r}", interval_s=interval_s
    )
    return value, time.monotonic() - started
