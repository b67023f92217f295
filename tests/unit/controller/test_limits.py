"""Issue 14, item 10: the ingest rate limit's defaults let one run of 2,048 agents posting once
a second through, and hold back a run that posts far more."""

from __future__ import annotations

import pytest

from slurmft.controller.limits import AuditThrottle, IngestLimiter, RateLimits, TokenBucket


def _refused(limiter: IngestLimiter, agents: int, seconds: int, per_second: int = 1) -> int:
    """Posts of ``agents`` agents, ``per_second`` each a second, all at the same instants (the
    worst case: every agent woken together), each batch with an event every tenth second."""
    refused = 0
    for second in range(seconds):
        for tick in range(per_second):
            now = second + tick / per_second
            for agent in range(agents):
                events = 1 if (second + agent) % 10 == 0 else 0
                refused += limiter.take("r1", events, now) > 0
    return refused


def test_the_defaults_let_a_run_of_2048_agents_posting_once_a_second_through() -> None:
    limiter = IngestLimiter(RateLimits())
    assert _refused(limiter, agents=2048, seconds=120) == 0


def test_a_run_posting_ten_times_that_is_held_back() -> None:
    limiter = IngestLimiter(RateLimits())
    refused = _refused(limiter, agents=2048, seconds=20, per_second=10)
    accepted = 2048 * 10 * 20 - refused
    # About the burst (10 s of 4,096) and 4,096 a second after it.
    assert 4096 * 10 + 4096 * 19 <= accepted <= 4096 * 10 + 4096 * 21


def test_a_whole_run_reporting_a_failure_at_once_fits_the_event_burst() -> None:
    limiter = IngestLimiter(RateLimits())
    assert sum(limiter.take("r1", 4, 0.0) > 0 for _ in range(2048)) == 0  # 8,192 events
    assert limiter.take("r1", 1000, 0.0) == 0  # 9,192
    assert limiter.take("r1", 1000, 0.0) == pytest.approx(
        0.192
    )  # past the 10,000 of the burst: wait
    assert limiter.take("r2", 1000, 0.0) == 0  # each run has its own buckets


def test_a_bucket_says_how_long_to_wait() -> None:
    bucket = TokenBucket(rate=2.0, burst=4.0)
    assert [bucket.take(1, 0.0) for _ in range(4)] == [0.0] * 4
    assert bucket.take(1, 0.0) == 0.5
    assert bucket.take(1, 0.5) == 0.0


def test_a_refusal_is_recorded_at_most_once_a_minute_per_run() -> None:
    audit = AuditThrottle()
    assert [audit.due("ingest_rate", "r1", t) for t in (0, 1, 59, 60, 61)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    assert audit.due("ingest_rate", "r2", 1) and audit.due("run_quota", "r1", 1)
