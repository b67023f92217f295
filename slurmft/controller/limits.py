"""Limits on what one user's runs may ask of the daemon: ingest rate per run, and how often a
refusal is written down.

Pure bookkeeping over a clock the caller passes in (monotonic seconds): the ingest writer asks
before it stores a batch, and answers 429 with the wait this says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmft.config import DaemonSection

# A refusal of the same kind for the same run (or user) is recorded at most once a minute: an
# agent retrying every second must not write a row a second.
AUDIT_EVERY_S = 60.0


@dataclass
class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; starts full."""

    rate: float
    burst: float
    tokens: float = -1.0
    at: float = 0.0

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` tokens: 0.0 when taken, else the seconds until they would be there
        (nothing is taken then)."""
        if self.tokens < 0:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if amount <= self.tokens:
            self.tokens -= amount
            return 0.0
        return (amount - self.tokens) / self.rate


@dataclass(frozen=True)
class RateLimits:
    """Per run: batches a second and events a second, each with ``burst_s`` seconds' worth
    saved up. Zero: no limit."""

    batches_per_s: float = DaemonSection.ingest_batches_per_run_s
    events_per_s: float = DaemonSection.ingest_events_per_run_s
    burst_s: float = DaemonSection.ingest_burst_s

    @classmethod
    def from_settings(cls, daemon: DaemonSection) -> RateLimits:
        return cls(
            daemon.ingest_batches_per_run_s, daemon.ingest_events_per_run_s, daemon.ingest_burst_s
        )


@dataclass
class IngestLimiter:
    """The buckets of every run that posted, and when each refusal kind was last recorded."""

    limits: RateLimits = field(default_factory=RateLimits)
    _batches: dict[str, TokenBucket] = field(default_factory=dict)
    _events: dict[str, TokenBucket] = field(default_factory=dict)

    def take(self, run_id: str, events: int, now: float) -> float:
        """0.0 when the run may post a batch of ``events`` events now; else the seconds to wait
        (and nothing is taken)."""
        limits = self.limits
        batches = events_bucket = None
        if limits.batches_per_s > 0:
            batches = self._batches.get(run_id)
            if batches is None:
                burst = max(1.0, limits.batches_per_s * limits.burst_s)
                batches = self._batches[run_id] = TokenBucket(limits.batches_per_s, burst)
            wait = batches.take(1, now)
            if wait:
                return wait
        if events and limits.events_per_s > 0:
            events_bucket = self._events.get(run_id)
            if events_bucket is None:
                burst = max(1.0, limits.events_per_s * limits.burst_s)
                events_bucket = self._events[run_id] = TokenBucket(limits.events_per_s, burst)
            wait = events_bucket.take(min(events, events_bucket.burst), now)
            if wait:
                if batches is not None:
                    batches.tokens += 1  # the batch was not taken either
                return wait
        return 0.0


class AuditThrottle:
    """Whether a refusal of ``kind`` for ``who`` should be written down now (at most once per
    ``every_s``)."""

    def __init__(self, every_s: float = AUDIT_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[tuple[str, str], float] = {}

    def due(self, kind: str, who: str, now: float) -> bool:
        last = self._last.get((kind, who))
        if last is not None and now - last < self.every_s:
            return False
        self._last[kind, who] = now
        return True
