"""Storing what each failure cost (slurmft.core.goodput), once training is back past it.

A periodic daemon job. For each run with a failure not measured yet, it reads the run's step
completions around it (ranks below ``SAMPLE_RANKS``: every rank ends every step, so a few tell
when a step ended, whatever the world size), the job's queue waits, and the checkpoints, and
writes the figures onto the failure's event: ``time_lost_s`` and its parts by cause. Reports of
one failure (a node lost, the GPU fault that caused it, the hang its peers then saw) are one
outage: its cost goes on the first, the others get 0 with the id they were counted with.

Stored at failure time, the figures outlive the folding of raw step times (retention), and the
failure-history views only add them up. It also keeps the run's first and last step times,
between which the effective ratio is taken.
"""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from slurmft.core.goodput import Completion, Lost, completions, estimate, measure, never_back
from slurmft.core.kinds import OUTAGE_KINDS
from slurmft.db.models import Attempt, Event, EventKind, Run, StepTime
from slurmft.db.states import RunState

log = logging.getLogger(__name__)

SAMPLE_RANKS = 8
# Earliest signs of an outage, besides its failure reports: a rank that saw its peer fail, a
# launcher that declared a silent peer dead, a node whose torchrun failed (a dead batch host's
# store ends every other node's torchrun, at times before any rank reports).
PEER_SIGNS = (EventKind.COLLECTIVE_ERROR, EventKind.PEER_DEAD, EventKind.LAUNCHER_FAILED)
SIGN_KINDS = (*OUTAGE_KINDS, *PEER_SIGNS)
SIGN_LEAD = timedelta(seconds=60)  # how long before a failure's report a peer may have seen it
LOOK_BACK = timedelta(minutes=30)  # step completions read before the first unmeasured failure
GIVE_UP_AFTER = timedelta(days=2)  # a failure still unmeasurable this late is left unmeasured
# A run's last steps reach the store up to a report interval after it ends.
SPAN_AFTER_END = timedelta(minutes=10)
# A script without steps: its agents restart its workers within this of the failure; a requeued
# or resubmitted job of it starts within the other.
PLAIN_BACK_WITHIN = timedelta(minutes=2)
PLAIN_REQUEUE_WITHIN = timedelta(minutes=30)
LIVE_STATES = [state for state in RunState if not state.is_terminal]


@dataclass(frozen=True)
class Measured:
    """An outage measured: the kind of its first report, how many reports it had, its cost."""

    kind: EventKind
    reports: int
    lost: Lost


def _unmeasured(session: Session, now: datetime) -> dict[str, datetime]:
    """Runs with outage reports not measured yet, and the earliest such report of each."""
    rows = session.execute(
        select(Event.run_id, func.min(Event.occurred_at))
        .where(
            Event.run_id.is_not(None),
            Event.kind.in_(OUTAGE_KINDS),
            Event.time_lost_s.is_(None),
            Event.foreign.is_not(True),
            Event.occurred_at >= now - GIVE_UP_AFTER,
        )
        .group_by(Event.run_id)
    ).all()
    return {run_id: at for run_id, at in rows if run_id is not None}


def _steps(session: Session, run_id: str, since: datetime) -> list[Completion]:
    rows = session.execute(
        select(StepTime.step, StepTime.ended_at, StepTime.rank).where(
            StepTime.run_id == run_id, StepTime.rank < SAMPLE_RANKS, StepTime.ended_at >= since
        )
    ).all()
    return completions((step, at, rank) for step, at, rank in rows)


def _queue_wait_s(attempts: Sequence[Attempt], start: datetime, end: datetime | None) -> float:
    """Time the run's jobs waited for Slurm between ``start`` and ``end``: each later attempt
    (a requeue, a resubmission) from its submission until Slurm started it."""
    waited = 0.0
    for attempt in attempts:
        if attempt.submitted_at < start or (end is not None and attempt.submitted_at > end):
            continue
        until = attempt.started_at or end
        if until is not None:
            waited += max((until - attempt.submitted_at).total_seconds(), 0.0)
    return waited


def _agent_restarts(
    session: Session, run_id: str, start: datetime, end: datetime
) -> list[datetime]:
    """When the run's agents restarted its workers (each agent, each new round), in a window."""
    return list(
        session.scalars(
            select(Event.occurred_at).where(
                Event.run_id == run_id,
                Event.kind == EventKind.RESTART,
                Event.source == "agent",
                Event.occurred_at >= start,
                Event.occurred_at <= end,
            )
        )
    )


def _plain_failed_at(session: Session, run_id: str, detected: datetime) -> datetime:
    """When a script without steps failed, as near as can be seen: its ranks' restart (torch
    notices a dead peer at once) if that came before the failure's report."""
    earlier = _agent_restarts(session, run_id, detected - SIGN_LEAD, detected)
    return min([detected, *earlier])


def _plain_back_at(session: Session, run_id: str, failed: datetime,
                   attempts: Sequence[Attempt]) -> datetime | None:  # fmt: skip
    """When a script without steps was running again: its agents' last restart of workers
    after the failure (every agent reports the new round), or the start of a later job of the
    run (a requeue, a resubmission), whichever is later."""
    restarted = _agent_restarts(session, run_id, failed, failed + PLAIN_BACK_WITHIN)
    started = [
        a.started_at for a in attempts
        if a.started_at and failed < a.started_at <= failed + PLAIN_REQUEUE_WITHIN
    ]  # fmt: skip
    found = [*restarted, *started]
    return max(found) if found else None


def _file_time(at: datetime, details: object) -> datetime:
    """A checkpoint's own time: a file the batch step found carries its mtime (its ordinal, in
    ns); a verified one is reported when written."""
    if isinstance(details, dict) and details.get("layout") not in (None, "slurmft"):
        ordinal = details.get("ordinal")
        if isinstance(ordinal, int) and not isinstance(ordinal, bool):
            return datetime.fromtimestamp(ordinal / 1e9, UTC)
    return at


def _checkpoint_times(session: Session, run_id: str, since: datetime) -> list[datetime]:
    """When the run's checkpoints were written (their own times), oldest first."""
    rows = session.execute(
        select(Event.occurred_at, Event.details).where(
            Event.run_id == run_id,
            Event.kind == EventKind.CHECKPOINT,
            Event.source == "agent",
            Event.occurred_at >= since,
        )
    ).all()
    return sorted(t for t in (_file_time(at, d) for at, d in rows) if t >= since)


def _plain_estimate(session: Session, run: Run, detected: datetime,
                    attempts: Sequence[Attempt]) -> Lost | None:  # fmt: skip
    """A script without steps: when it was back is read from its checkpoint files' cadence
    (the first file after the failure, less the usual time between two files: it resumed that
    long before), else from its ranks' relaunch; the work since its newest file before the
    failure is done again. None until a file after the failure shows it back and two files on
    one side of it show the cadence (or the run ended)."""
    failed = _plain_failed_at(session, run.id, detected)
    relaunched = _plain_back_at(session, run.id, failed, attempts)
    if relaunched is None:
        return None
    files = _checkpoint_times(session, run.id, failed - LOOK_BACK)
    before = [t for t in files if t <= failed]
    after = [t for t in files if t > relaunched]
    cadence = before[-4:] if len(before) >= 2 else after[:4]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(cadence)]
    if not run.state.is_terminal and (not after or not gaps):
        # Back, but how far along is not seen yet, or the cadence is not (one file before the
        # failure and one after: the gap between them spans the outage). Taken as back at its
        # relaunch, a failure late in an interval was measured a third short.
        return None
    back = relaunched
    if after and gaps:
        back = max(after[0] - timedelta(seconds=statistics.median(gaps)), relaunched)
    if before:
        work_since: datetime | None = before[-1]
    else:  # from the job's start, less its start-up (taken as long as this restart's)
        started = [a.started_at for a in attempts if a.started_at and a.started_at <= failed]
        work_since = max(started) + (back - relaunched) if started else None
    queue = _queue_wait_s(attempts, failed, back)
    return estimate(failed, back, work_since, queue)


def _lost(session: Session, run: Run, steps: Sequence[Completion], detected: datetime,
          attempts: Sequence[Attempt]) -> Lost | None:  # fmt: skip
    """The outage's cost, or None while it cannot be known yet."""
    measured_steps = any(c.at <= detected for c in steps)
    if measured_steps:
        first_after = next((c.at for c in steps if c.at > detected), None)
        lost = measure(steps, detected, _queue_wait_s(attempts, detected, first_after))
        if lost is None and run.state.is_terminal and run.ended_at is not None:
            return never_back(steps, detected, run.ended_at)
        return lost
    lost = _plain_estimate(session, run, detected, attempts)
    if lost is None and run.state.is_terminal and run.ended_at is not None:
        return never_back(steps, detected, run.ended_at)
    return lost


def _store(first: Event, counted_with: Sequence[Event], lost: Lost) -> None:
    first.time_lost_s = round(lost.total_s, 3)
    first.lost_detection_s = round(lost.detection_s, 3)
    first.lost_restart_s = round(lost.restart_s, 3)
    first.lost_queue_wait_s = round(lost.queue_wait_s, 3)
    first.lost_replay_s = round(lost.replay_s, 3)
    first.time_lost_estimate = lost.estimate
    first.details = {
        **(first.details or {}),
        "goodput": {"last_step": lost.last_step, "resumed_from": lost.resumed_from,
                    "back_at": lost.back_at.isoformat() if lost.back_at else None},
    }  # fmt: skip
    for other in counted_with:
        _store_counted(other, first)


def _store_counted(event: Event, head: Event) -> None:
    """Another report of ``head``'s outage: its cost is on the head."""
    event.time_lost_s = 0.0
    event.lost_detection_s = event.lost_restart_s = 0.0
    event.lost_queue_wait_s = event.lost_replay_s = 0.0
    event.time_lost_estimate = head.time_lost_estimate
    event.details = {**(event.details or {}), "time_lost_counted_on": head.id}


def _step_span(session: Session, run: Run) -> None:
    """The run's first step start and newest step end, from the raw step times (before
    retention folds them)."""
    start, end = session.execute(
        select(func.min(StepTime.ended_at), func.max(StepTime.ended_at)).where(
            StepTime.run_id == run.id
        )
    ).one()
    if start is not None and run.first_step_at is None:
        first_s = session.scalar(
            select(func.max(StepTime.compute_s + StepTime.wait_s)).where(
                StepTime.run_id == run.id, StepTime.ended_at == start
            )
        )
        run.first_step_at = start - timedelta(seconds=float(first_s or 0.0))
    if end is not None and (run.last_step_at is None or end > run.last_step_at):
        run.last_step_at = end


# A measured outage's head, and when its span began (S) and ended (training back).
Span = tuple[Event, datetime, datetime]


def _measured_spans(session: Session, run_id: str) -> list[Span]:
    """Each measured outage's head and its span, from S to when training was back."""
    heads = session.scalars(
        select(Event).where(
            Event.run_id == run_id, Event.kind.in_(OUTAGE_KINDS), Event.time_lost_s > 0
        )
    ).all()
    spans = []
    for head in heads:
        back = (head.details or {}).get("goodput", {}).get("back_at")
        if isinstance(back, str):
            start = head.occurred_at - timedelta(seconds=head.lost_detection_s or 0.0)
            spans.append((head, start, datetime.fromisoformat(back)))
    return spans


def _unexplained_signs(
    session: Session, run_id: str, spans: Sequence[Span], start: datetime, end: datetime
) -> list[datetime]:
    """When peers saw trouble in [start, end) that no measured outage's span holds."""
    signs = session.scalars(
        select(Event.occurred_at).where(
            Event.run_id == run_id,
            Event.kind.in_(PEER_SIGNS),
            Event.occurred_at >= start,
            Event.occurred_at < end,
            Event.foreign.is_not(True),
        )
    ).all()
    return [at for at in signs if not any(a <= at <= b for _, a, b in spans)]


def _late_reports(failures: Sequence[Event], spans: Sequence[Span]) -> list[Event]:
    """The reports not part of an outage measured already. One that arrived after its outage
    was measured (an agent's report of the hang it ended, sent with its stacks) falls inside
    that outage's span, from S to when training was back: it gets 0, counted with it."""
    left = []
    for event in failures:
        within = next((h for h, a, b in spans if a <= event.occurred_at <= b), None)
        if within is not None and event.kind in OUTAGE_KINDS and event.time_lost_s is None:
            _store_counted(event, within)
        else:
            left.append(event)
    return left


def measure_run(session: Session, run: Run, since: datetime) -> list[Measured]:
    """Measure the run's outages from ``since`` on; returns those measured now."""
    steps = _steps(session, run.id, since - LOOK_BACK)
    # A peer's word may come before the failure's own report; one before the last step that
    # ended before that report belongs to an earlier trouble, which training got past.
    last_before = max((c.at for c in steps if c.at <= since), default=since - SIGN_LEAD)
    floor = max(last_before, since - SIGN_LEAD)
    # Unless that trouble is this report's own: peers' signs no measured outage accounts for,
    # when training was back before the report came (see _own_late_report).
    spans = _measured_spans(session, run.id)
    unexplained = _unexplained_signs(session, run.id, spans, since - SIGN_LEAD, floor)
    if unexplained:
        floor = min(floor, *unexplained)
    failures = session.scalars(
        select(Event)
        .where(
            Event.run_id == run.id,
            Event.kind.in_(SIGN_KINDS),
            Event.occurred_at >= floor,
            Event.foreign.is_not(True),
        )
        .order_by(Event.occurred_at, Event.id)
    ).all()
    attempts = session.scalars(
        select(Attempt).where(Attempt.run_id == run.id).order_by(Attempt.number)
    ).all()
    failures = _late_reports(failures, spans)
    stored: list[Measured] = []
    i = 0
    while i < len(failures):
        first = failures[i]
        lost = _lost(session, run, steps, first.occurred_at, attempts)
        if lost is None:
            break  # not back yet: this outage, and any after it, next time
        # Reports up to when training was back are this outage's (a script without steps may
        # be back, its ranks restarted, before the failure's own report).
        end = max(lost.back_at or first.occurred_at, first.occurred_at)
        group = [e for e in failures[i:] if e.occurred_at <= end]
        late = _own_late_report(failures[i + len(group) :], first) if all(
            e.kind in PEER_SIGNS for e in group) else None  # fmt: skip
        if late is not None:
            group.append(late)
        i += max(len(group), 1)
        outages = [e for e in group if e.kind in OUTAGE_KINDS]
        if not outages or all(e.time_lost_s is not None for e in outages):
            continue  # only a peer's word (no failure on record), or measured already
        head, *rest = outages
        _store(head, rest, lost)
        stored.append(Measured(head.kind, len(outages), lost))
    return stored


def _own_late_report(after: Sequence[Event], first: Event) -> Event | None:
    """The failure report of an outage its peers saw, that came after training was back: a
    node loss recovers (spare, warm workers, dead-peer eviction) in seconds, sooner than the
    daemon confirms the loss. The next report, if it is a failure's, not measured, and within
    SIGN_LEAD of the first sign, with no other peer's sign before it (which would be a new
    trouble's)."""
    if not after:
        return None
    event = after[0]
    if event.kind in PEER_SIGNS or event.occurred_at - first.occurred_at > SIGN_LEAD:
        return None
    return event if event.time_lost_s is None else None


def measure_failures(session: Session, now: datetime) -> list[Measured]:
    """One pass over every run with an unmeasured outage (and the step span of live runs);
    returns the outages measured now."""
    stored: list[Measured] = []
    for run_id, earliest in _unmeasured(session, now).items():
        run = session.get(Run, run_id)
        if run is not None:
            stored.extend(measure_run(session, run, earliest))
    live = session.scalars(
        select(Run).where(
            Run.started_at.is_not(None),
            Run.state.in_(LIVE_STATES) | (Run.ended_at >= now - SPAN_AFTER_END),
        )
    ).all()
    for run in live:
        _step_span(session, run)
    return stored
