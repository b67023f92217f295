"""A periodic job that outlasts its ticks: one line when it overruns, one when it ends, against
APScheduler's line per skipped tick. Run on a real BackgroundScheduler."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from apscheduler.events import (
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_SUBMITTED,
    JobEvent,
    JobExecutionEvent,
    JobSubmissionEvent,
)
from apscheduler.schedulers.background import BackgroundScheduler

from slurmft.controller.busy_jobs import (
    BUSY_JOB_EVENTS,
    BusyJobs,
    _not_a_busy_skip,
    quiet_busy_skips,
)

SKIPS_BEFORE_RELEASE = 4


@pytest.fixture
def scheduler_logger(caplog: pytest.LogCaptureFixture) -> Iterator[logging.Logger]:
    """APScheduler's logger as a fresh process has it, at INFO: without the filter, which a
    daemon made earlier in this process (another test's) has added."""
    logger = logging.getLogger("apscheduler.scheduler")
    logger.removeFilter(_not_a_busy_skip)
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="apscheduler")  # setup_logging raises it to WARNING
    yield logger
    logger.removeFilter(_not_a_busy_skip)


def run_one_long_job(busy: BusyJobs) -> int:
    """A job on 50 ms ticks whose one run lasts until SKIPS_BEFORE_RELEASE ticks were skipped for
    it and the job was removed (so that no tick comes after); returns the ticks skipped."""
    scheduler = BackgroundScheduler(
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30}
    )
    skipped: list[JobEvent] = []
    enough_skipped, removed = threading.Event(), threading.Event()

    def count_skip(event: JobEvent) -> None:
        skipped.append(event)
        if len(skipped) >= SKIPS_BEFORE_RELEASE:
            enough_skipped.set()

    scheduler.add_listener(busy.on_event, BUSY_JOB_EVENTS)
    scheduler.add_listener(count_skip, EVENT_JOB_MAX_INSTANCES)
    scheduler.add_job(lambda: removed.wait(10), "interval", seconds=0.05, id="control")
    scheduler.start()
    try:
        assert enough_skipped.wait(10), f"only {len(skipped)} ticks skipped in 10 s"
        scheduler.remove_job("control")
    finally:
        removed.set()
        scheduler.shutdown(wait=True)  # the run's end and its events are through
    return len(skipped)


def lines(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and text in r.getMessage()]


def test_an_overrun_is_said_once_when_it_starts_and_once_when_it_ends(
    caplog: pytest.LogCaptureFixture, scheduler_logger: logging.Logger
) -> None:
    quiet_busy_skips()
    skipped = run_one_long_job(BusyJobs())
    assert skipped >= SKIPS_BEFORE_RELEASE
    assert lines(caplog, "apscheduler.scheduler", "maximum number of running instances") == []
    started = lines(caplog, "slurmft.controller.busy_jobs", "control job still running after")
    assert [r.levelno for r in started] == [logging.WARNING]
    ended = lines(caplog, "slurmft.controller.busy_jobs", "control job ended after")
    assert len(ended) == 1
    assert ended[0].levelno == logging.INFO
    assert f"; {skipped} ticks skipped while it ran" in ended[0].getMessage()


def test_without_the_filter_apscheduler_says_every_skipped_tick(
    caplog: pytest.LogCaptureFixture, scheduler_logger: logging.Logger
) -> None:
    """What the filter removes: the line per tick that a stuck pass used to repeat."""
    skipped = run_one_long_job(BusyJobs())
    assert len(lines(caplog, "apscheduler.scheduler", "maximum number of running")) == skipped


def test_the_filter_keeps_apschedulers_other_lines(scheduler_logger: logging.Logger) -> None:
    quiet_busy_skips()
    quiet_busy_skips()  # idempotent: one filter
    assert scheduler_logger.filters.count(_not_a_busy_skip) == 1
    record = scheduler_logger.makeRecord(
        "apscheduler.scheduler", logging.ERROR, __file__, 0, 'Job "%s" raised', ("x",), None
    )
    assert scheduler_logger.filter(record)


def submitted(job_id: str, at: datetime) -> JobSubmissionEvent:
    return JobSubmissionEvent(EVENT_JOB_SUBMITTED, job_id, "default", [at])


def executed(job_id: str, at: datetime) -> JobExecutionEvent:
    return JobExecutionEvent(EVENT_JOB_EXECUTED, job_id, "default", at)


def skipped_tick(job_id: str) -> JobSubmissionEvent:
    """As APScheduler tells it: a submission event with the skip's code."""
    return JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, job_id, "default", [datetime.now(UTC)])


STILL_RUNNING = (
    "retention job still running after {}, past its next tick: its ticks are skipped until it "
    "ends (counted in slurmft_scheduler_jobs_skipped_total)"
)


def test_each_overrun_is_said_with_its_own_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="slurmft.controller.busy_jobs")
    now = [0.0]
    busy = BusyJobs(monotonic=lambda: now[0])
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for k, skips in enumerate((3, 0, 1)):
        at = t0 + timedelta(minutes=k)
        busy.on_event(submitted("retention", at))
        for _ in range(skips):
            now[0] += 1.0
            busy.on_event(skipped_tick("retention"))
        busy.on_event(executed("retention", at))
    assert caplog.messages == [
        STILL_RUNNING.format("1.0s"),
        "retention job ended after 3.0s; 3 ticks skipped while it ran",
        STILL_RUNNING.format("1.0s"),
        "retention job ended after 1.0s; 1 tick skipped while it ran",
    ]


def test_an_end_told_after_the_next_run_started_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pool frees the job's slot before it sends the run's end: the next run can be
    submitted first. The overrun ends at that submission; the late end is not a second one."""
    caplog.set_level(logging.INFO, logger="slurmft.controller.busy_jobs")
    now = [0.0]
    busy = BusyJobs(monotonic=lambda: now[0])
    first, second = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    busy.on_event(submitted("retention", first))
    now[0] = 2.0
    busy.on_event(skipped_tick("retention"))
    busy.on_event(skipped_tick("retention"))
    busy.on_event(submitted("retention", second))
    busy.on_event(executed("retention", first))
    busy.on_event(executed("retention", second))
    assert caplog.messages == [
        STILL_RUNNING.format("2.0s"),
        "retention job ended after 2.0s; 2 ticks skipped while it ran",
    ]


def test_a_skip_before_any_start_seen_is_said_without_a_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="slurmft.controller.busy_jobs")
    busy = BusyJobs()
    busy.on_event(skipped_tick("retention"))
    busy.on_event(submitted("retention", datetime(2026, 1, 1, tzinfo=UTC)))
    assert caplog.messages == [
        STILL_RUNNING.format("an unknown time"),
        "retention job ended after an unknown time; 1 tick skipped while it ran",
    ]
