"""Clock skew against the controller. Rendezvous keep-alive expiry compares wall clocks across
nodes (a heartbeat written by one node is judged by another's clock), so a skew near the
keep-alive window (~4 s) removes live nodes or keeps dead ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SKEW_S = 1.0


@dataclass(frozen=True)
class ClockSkew:
    offset_s: float  # controller clock minus ours
    round_trip_s: float

    def too_large(self, limit_s: float = MAX_SKEW_S) -> bool:
        # The midpoint estimate is off by at most half the round trip.
        return abs(self.offset_s) - self.round_trip_s / 2 > limit_s


def measure_skew(
    server_time: Callable[[], float], clock: Callable[[], float] = time.time, samples: int = 3
) -> ClockSkew:
    """Best of `samples` round trips (the shortest bounds the error best)."""
    best: ClockSkew | None = None
    for _ in range(samples):
        sent = clock()
        theirs = server_time()
        received = clock()
        sample = ClockSkew(theirs - (sent + received) / 2, received - sent)
        if best is None or sample.round_trip_s < best.round_trip_s:
            best = sample
    assert best is not None
    return best
