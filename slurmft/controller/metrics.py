"""The daemon's Prometheus metrics: ``slurmft_`` prefix, base units, ``_total`` counters.

Two kinds of value, kept apart on purpose:

- What the daemon process sees as it works (Slurm command latency and errors, ingest requests,
  control passes, scheduler lag, detection latency) lives in ordinary metric objects; like every
  Prometheus counter these start again from zero when the daemon restarts.
- What lives in the store (runs by state, recoveries, drains, straggler flags, failures) is read
  at scrape time by ``StoreCollector``, so it is right after a restart and agrees with
  ``slurmft history``. Those counters are counts of rows that are kept for good (``actions``,
  ``events``), so they only go up.

No run id is ever a label: a site runs thousands of runs and each would be a new time series.
Each registry is private to its daemon (never the global one), so tests can build several.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import time
from collections.abc import Iterable, Sequence

from apscheduler.events import (
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    EVENT_JOB_SUBMITTED,
    JobEvent,
    JobSubmissionEvent,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from slurmft.controller.goodput_pass import GIVE_UP_AFTER
from slurmft.controller.pass_health import HOLD_AFTER, count_held
from slurmft.core.kinds import OUTAGE_KINDS
from slurmft.db import Database, DatabaseError
from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind, Run, utcnow
from slurmft.db.states import RunState
from slurmft.slurm.api import SlurmTimeout, SlurmUnreachable
from slurmft.slurm.runner import CommandResult, Runner
from slurmft.version import version

log = logging.getLogger(__name__)

# Actions that bring a run back after a failure. agent_leave is "the node leaves, a spare or the
# survivors carry on"; restart_workers is a hang's restart in place.
RECOVERY_KINDS = (
    ActionKind.AGENT_LEAVE,
    ActionKind.RESTART_WORKERS,
    ActionKind.REQUEUE,
    ActionKind.RESUBMIT,
)
# A recovery counts once it was acted on (done) or handed to the agent (planned); observe-only
# (skipped) and failed ones are not recoveries.
COUNTED_STATUSES = (ActionStatus.DONE, ActionStatus.PLANNED)
FAILURE_KINDS = (
    EventKind.RANK_FAILURE,
    EventKind.NODE_LOST,
    EventKind.GPU_FAULT,
    EventKind.HANG,
    EventKind.STRAGGLER,
    EventKind.BATCH_HOST_DOWN,
    EventKind.PREFLIGHT_FAILED,
)  # the failures of docs/failure-history.md; a silent report channel is not one
# The ingest answers that are refusals (slurmft_refusals_total's label for each).
INGEST_REFUSALS = {
    400: "invalid_batch",
    401: "token",
    403: "token",
    411: "invalid_batch",
    413: "too_large",
    422: "invalid_items",
    429: "ingest_rate",
}
# Seconds: from a Slurm command of a few ms to one that runs into its timeout.
SLURM_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DETECTION_BUCKETS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800)
PASS_OUTCOMES = ("completed", "skipped_slurm", "skipped_store", "error")
# The commands the daemon runs (slurmft.slurm.commands), each with its error series at zero.
SLURM_COMMANDS = ("squeue", "sinfo", "scontrol", "sbatch", "scancel")
RECOVERY_BUCKETS = (5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


class DaemonMetrics:
    """Every metric of one daemon, in its own registry."""

    def __init__(self, database: Database | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("slurmft_build", "Version of the running slurmft daemon.", registry=r).info(
            {"version": version(), "python": platform.python_version()}
        )
        self.control_passes = Counter(
            "slurmft_control_passes_total",
            "Control passes by outcome: completed, skipped because Slurm or the store was "
            "unreachable, or error (an unexpected exception).",
            ["outcome"],
            registry=r,
        )
        self.control_pass_duration = Histogram(
            "slurmft_control_pass_duration_seconds",
            "Wall time of one observe-decide-act pass.",
            buckets=SLURM_BUCKETS,
            registry=r,
        )
        self.last_control_pass = Gauge(
            "slurmft_last_control_pass_timestamp_seconds",
            "Unix time the last control pass ended (completed or skipped).",
            registry=r,
        )
        self.detection_latency = Histogram(
            "slurmft_detection_latency_seconds",
            "From a failure's first evidence to its event row, for failures the daemon finds: a "
            "hang's silence; otherwise the time since the previous pass saw the run (an upper "
            "bound of the loop's share).",
            ["kind"],
            buckets=DETECTION_BUCKETS,
            registry=r,
        )
        self.recovery_latency = Histogram(
            "slurmft_recovery_seconds",
            "From an outage's detection until training was back (its detection, restart and "
            "queue wait, slurmft.core.goodput), observed as the goodput pass measures it.",
            ["kind"],
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        for kind in OUTAGE_KINDS:  # every kind's series exists from the start, at zero
            self.recovery_latency.labels(kind.value)
        self.ingest_requests = Counter(
            "slurmft_ingest_requests_total",
            "Agent report batches received, by HTTP status (200 accepted; else refused/error).",
            ["code"],
            registry=r,
        )
        self.refusals = Counter(
            "slurmft_refusals_total",
            "Requests refused by a bound, a quota or a rate limit, by limit: run_quota (a "
            "submit past daemon.max_active_runs_per_user), ingest_rate (429), invalid_items "
            "(422: some items of a batch), invalid_batch (400), token (401/403), too_large "
            "(413).",
            ["limit"],
            registry=r,
        )
        self.ingest_duration = Histogram(
            "slurmft_ingest_request_duration_seconds",
            "Time to answer one agent batch, store write included.",
            buckets=SLURM_BUCKETS,
            registry=r,
        )
        self.server_refusals = Counter(
            "slurmft_server_refusals_total",
            "Connections and requests an endpoint (ingest, socket, metrics) refused before "
            "reading a request through: over_capacity, header_timeout, idle_timeout, "
            "head_too_large, tls_handshake, no_token, unknown_token, no_length, bad_length, "
            "too_large, body_timeout, short_body.",
            ["server", "reason"],
            registry=r,
        )
        self.slurm_duration = Histogram(
            "slurmft_slurm_command_duration_seconds",
            "Wall time of one Slurm command (squeue, sinfo, scontrol, ...).",
            ["command"],
            buckets=SLURM_BUCKETS,
            registry=r,
        )
        self.slurm_errors = Counter(
            "slurmft_slurm_command_errors_total",
            "Slurm commands that failed: timeout, unreachable (not installed), or exit_status.",
            ["command", "error"],
            registry=r,
        )
        self.scheduler_lag = Histogram(
            "slurmft_scheduler_job_lag_seconds",
            "How late a periodic job (control, retention, watchdog) started after its time.",
            ["job"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.scheduler_skipped = Counter(
            "slurmft_scheduler_jobs_skipped_total",
            "Periodic job runs not started: missed (too late) or busy (the previous one is still "
            "running, as when the control pass is stuck).",
            ["job", "reason"],
            registry=r,
        )
        self._start_at_zero()
        if database is not None:
            r.register(StoreCollector(database))

    def _start_at_zero(self) -> None:
        """The series the dashboard and alerts read exist from the start, at zero: a rate of
        a series that appears only with its first error reads as no data, not as none."""
        for outcome in PASS_OUTCOMES:
            self.control_passes.labels(outcome)
        for code in ("200", *map(str, INGEST_REFUSALS), "503"):
            self.ingest_requests.labels(code)
        for limit in {"run_quota", *INGEST_REFUSALS.values()}:
            self.refusals.labels(limit)
        for command in SLURM_COMMANDS:
            for error in ("timeout", "unreachable", "exit_status"):
                self.slurm_errors.labels(command, error)

    # --- hooks for the parts that do the work ---------------------------------------------

    def observe_ingest(self, status: int, seconds: float) -> None:
        self.ingest_requests.labels(str(status)).inc()
        self.ingest_duration.observe(seconds)
        refused = INGEST_REFUSALS.get(status)
        if refused is not None:
            self.count_refusal(refused)

    def observe_recovery(self, kind: EventKind, seconds: float) -> None:
        self.recovery_latency.labels(kind.value).observe(seconds)

    def count_refusal(self, limit: str) -> None:
        self.refusals.labels(limit).inc()

    def on_scheduler_event(self, event: JobEvent) -> None:
        """APScheduler listener (EVENT_JOB_SUBMITTED | EVENT_JOB_MISSED | _MAX_INSTANCES)."""
        if event.code == EVENT_JOB_SUBMITTED and isinstance(event, JobSubmissionEvent):
            now = time.time()
            for scheduled in event.scheduled_run_times:
                self.scheduler_lag.labels(event.job_id).observe(
                    max(0.0, now - scheduled.timestamp())
                )
        elif event.code == EVENT_JOB_MISSED:
            self.scheduler_skipped.labels(event.job_id, "missed").inc()
        elif event.code == EVENT_JOB_MAX_INSTANCES:
            self.scheduler_skipped.labels(event.job_id, "busy").inc()


SCHEDULER_EVENTS = EVENT_JOB_SUBMITTED | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES


class TimedRunner:
    """The Slurm Runner seam with each command's latency and failures counted."""

    def __init__(self, inner: Runner, metrics: DaemonMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        command = os.path.basename(argv[0]) if argv else "?"
        started = time.monotonic()
        try:
            result = self._inner.run(argv, timeout, stdin=stdin)
        except SlurmTimeout:
            self._metrics.slurm_errors.labels(command, "timeout").inc()
            raise
        except SlurmUnreachable:
            self._metrics.slurm_errors.labels(command, "unreachable").inc()
            raise
        finally:
            self._metrics.slurm_duration.labels(command).observe(time.monotonic() - started)
        if not result.ok:
            self._metrics.slurm_errors.labels(command, "exit_status").inc()
        return result


class StoreCollector(Collector):
    """Counts that live in the store, read at every scrape (a few GROUP BY queries)."""

    def __init__(self, database: Database) -> None:
        self._db = database

    def describe(self) -> Iterable[Metric]:
        return []  # values come from the store at scrape time only

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("slurmft_store_up", "1 when the store answered this scrape.")
        try:
            families = self._read()
        except DatabaseError as exc:
            log.warning("metrics: store unreachable during scrape: %s", exc)
            up.add_metric([], 0)
            return [up]
        except Exception:  # a scrape must never take the endpoint down
            log.exception("metrics: reading the store failed")
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        return [up, *families]

    def _read(self) -> list[Metric]:
        with self._db.session() as s:
            runs = dict(s.execute(select(Run.state, func.count()).group_by(Run.state)).all())
            recoveries = dict(
                s.execute(
                    select(Action.kind, func.count())
                    .where(Action.kind.in_(RECOVERY_KINDS), Action.status.in_(COUNTED_STATUSES))
                    .group_by(Action.kind)
                ).all()
            )
            drains = dict(
                s.execute(
                    select(Action.status, func.count())
                    .where(Action.kind == ActionKind.DRAIN_NODE)
                    .group_by(Action.status)
                ).all()
            )
            failures = dict(
                s.execute(
                    select(Event.kind, func.count())
                    .where(Event.kind.in_(FAILURE_KINDS))
                    .group_by(Event.kind)
                ).all()
            )
            goodput = _goodput_families(s)
            held = count_held(s)
        by_state = GaugeMetricFamily("slurmft_runs", "Runs by state.", labels=["state"])
        for state in RunState:
            by_state.add_metric([state.value], runs.get(state, 0))
        recovered = CounterMetricFamily(
            "slurmft_recoveries", "Recovery actions taken, by kind.", labels=["kind"]
        )
        for kind in RECOVERY_KINDS:
            recovered.add_metric([kind.value], recoveries.get(kind, 0))
        drained = CounterMetricFamily(
            "slurmft_drains",
            "Node drains by outcome: done, skipped (not permitted: recorded as 'drain "
            "requested'; or observe-only), failed, planned.",
            labels=["status"],
        )
        for status in ActionStatus:
            drained.add_metric([status.value], drains.get(status, 0))
        stragglers = CounterMetricFamily(
            "slurmft_straggler_flags", "Ranks flagged as stragglers (events)."
        )
        stragglers.add_metric([], failures.get(EventKind.STRAGGLER, 0))
        failed = CounterMetricFamily(
            "slurmft_failures", "Failure events recorded, by kind.", labels=["kind"]
        )
        for failure in FAILURE_KINDS:
            failed.add_metric([failure.value], failures.get(failure, 0))
        held_runs = GaugeMetricFamily(
            "slurmft_runs_held",
            "Live runs held: their part of the control pass failed "
            f"{HOLD_AFTER} passes in a row, and only a cancel is carried out for them until an "
            "admin releases them (`slurmft release-run RUN`).",
        )
        held_runs.add_metric([], held)
        return [by_state, recovered, drained, stragglers, failed, held_runs, *goodput]


LOST_PARTS = {
    "detection": Event.lost_detection_s,
    "restart": Event.lost_restart_s,
    "queue_wait": Event.lost_queue_wait_s,
    "replay": Event.lost_replay_s,
}


def _goodput_families(session: Session) -> list[Metric]:
    """Training time lost by cause and the runs' wall time (both only grow: fleet goodput is
    1 - rate(lost) / rate(wall)), the lowest effective ratio among live runs (no run id as a
    label), and the outages not measured yet. Read from the store's figures and its
    run_effective_time view (docs/failure-history.md)."""
    sums = session.execute(
        select(*(func.coalesce(func.sum(column), 0.0) for column in LOST_PARTS.values())).where(
            Event.kind.in_(OUTAGE_KINDS)
        )
    ).one()
    # Those the goodput pass still tries (older ones, and those from before it, stay unmeasured).
    unmeasured = session.scalar(
        select(func.count()).where(
            Event.kind.in_(OUTAGE_KINDS),
            Event.time_lost_s.is_(None),
            Event.foreign.is_not(True),
            Event.occurred_at >= utcnow() - GIVE_UP_AFTER,
        )
    )
    live = [f"'{state.value}'" for state in RunState if not state.is_terminal]
    wall, lowest = session.execute(
        text(
            "SELECT COALESCE(SUM(wall_s), 0), "
            f"MIN(CASE WHEN state IN ({', '.join(live)}) THEN effective_ratio END) "
            "FROM run_effective_time"
        )
    ).one()
    lost = CounterMetricFamily(
        "slurmft_time_lost_seconds",
        "Training time lost to outages, by cause (detection, restart, queue_wait, replay), as "
        "measured once training was back past each.",
        labels=["cause"],
    )
    for cause, value in zip(LOST_PARTS, sums, strict=True):
        lost.add_metric([cause], float(value))
    walls = CounterMetricFamily(
        "slurmft_run_wall_seconds",
        "The runs' wall time, from each one's first step to its last (now, while it runs).",
    )
    walls.add_metric([], float(wall or 0.0))
    waiting = GaugeMetricFamily(
        "slurmft_outages_unmeasured",
        "Outages of the last two days whose cost is not measured yet (not back past them).",
    )
    waiting.add_metric([], float(unmeasured or 0))
    worst = GaugeMetricFamily(
        "slurmft_live_run_effective_ratio_min",
        "The lowest effective ratio so far among the runs still live (NaN: none is).",
    )
    worst.add_metric([], math.nan if lowest is None else float(lowest))
    return [lost, walls, waiting, worst]
