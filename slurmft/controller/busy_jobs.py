"""A periodic job that outlasts its interval, said once per overrun instead of once per tick.

With ``max_instances=1`` APScheduler skips a job's tick while its previous run is still going and
logs a WARNING for every skipped tick: a control pass stuck on a 30 s Slurm command at a 1 s
interval wrote thirty identical lines, which buried the one line that says what is wrong. The
daemon drops those lines (``quiet_busy_skips``) and logs instead the overrun's start (the first
skipped tick, WARNING) and its end (INFO, with how long the run took and how many ticks it
skipped). The skips are still counted one by one in ``slurmft_scheduler_jobs_skipped_total``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_SUBMITTED,
    JobEvent,
    JobExecutionEvent,
    JobSubmissionEvent,
)

log = logging.getLogger(__name__)

# The events `BusyJobs.on_event` reads: a run starting and ending, and a tick skipped for it.
BUSY_JOB_EVENTS = (
    EVENT_JOB_SUBMITTED | EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MAX_INSTANCES
)
# APScheduler's own per-tick line (apscheduler/schedulers/base.py, `_process_jobs`).
_APSCHEDULER_BUSY_LINE = "skipped: maximum number of running instances reached"


def _not_a_busy_skip(record: logging.LogRecord) -> bool:
    return _APSCHEDULER_BUSY_LINE not in str(record.msg)


def quiet_busy_skips(scheduler_logger: str = "apscheduler.scheduler") -> None:
    """Drop APScheduler's per-tick "skipped" warning; `BusyJobs` says it once instead.
    Idempotent: a logger keeps one copy of a given filter."""
    logging.getLogger(scheduler_logger).addFilter(_not_a_busy_skip)


@dataclass
class _Run:
    scheduled: datetime | None  # the run's scheduled time: its end event names it
    started: float | None
    skipped: int = 0


class BusyJobs:
    """Per job, its latest run: when it started and how many ticks were skipped for it."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._lock = threading.Lock()  # events come from the scheduler's and the pool's threads
        self._runs: dict[str, _Run] = {}

    def on_event(self, event: JobEvent) -> None:
        """APScheduler listener for `BUSY_JOB_EVENTS`."""
        with self._lock:
            # A skipped tick is told as a JobSubmissionEvent too: its code says which it is.
            if event.code == EVENT_JOB_MAX_INSTANCES:
                self._skipped_tick(event.job_id)
            elif isinstance(event, JobSubmissionEvent):
                self._submitted(event.job_id, event.scheduled_run_times[-1])
            elif isinstance(event, JobExecutionEvent):
                run = self._runs.get(event.job_id)
                # A run's end can be told after the next run started (the pool frees the slot,
                # then sends the event): that run was settled when the next one was submitted.
                if run is not None and run.scheduled == event.scheduled_run_time:
                    del self._runs[event.job_id]
                    self._log_end(event.job_id, run)

    def _submitted(self, job_id: str, scheduled: datetime) -> None:
        previous = self._runs.get(job_id)
        if previous is not None:  # max_instances=1: a new run means the previous one ended
            self._log_end(job_id, previous)
        self._runs[job_id] = _Run(scheduled, self._monotonic())

    def _skipped_tick(self, job_id: str) -> None:
        run = self._runs.setdefault(job_id, _Run(None, None))
        run.skipped += 1
        if run.skipped == 1:
            log.warning(
                "%s job still running after %s, past its next tick: its ticks are skipped until "
                "it ends (counted in slurmft_scheduler_jobs_skipped_total)",
                job_id,
                self._running_for(run),
            )

    def _log_end(self, job_id: str, run: _Run) -> None:
        if run.skipped:
            log.info(
                "%s job ended after %s; %d tick%s skipped while it ran",
                job_id,
                self._running_for(run),
                run.skipped,
                "" if run.skipped == 1 else "s",
            )

    def _running_for(self, run: _Run) -> str:
        if run.started is None:
            return "an unknown time"
        return f"{self._monotonic() - run.started:.1f}s"
