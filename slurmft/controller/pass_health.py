"""Which runs' parts of the control pass fail, pass after pass, and the hold that ends it.

Each run is observed, decided and acted on in isolation (docs/architecture.md, "One control
pass"): a failure in one run's part (its stored data, a hostile value that got past a check, a
bug) is recorded on that run as a `control_error` event, and the pass goes on for the others.
Only the store or Slurm being unreachable skips the whole pass.

A run whose part fails `HOLD_AFTER` passes in a row is *held*: its part is no longer tried
(it would fail again, every pass, for ever), except for its owner's cancel, which is still
carried out. The hold is an action row with the error, and `slurmft status`, `/healthz` and the
`slurmft_runs_held` metric show it. An admin releases it (`slurmft release-run RUN`) once the
cause is mended; the next pass tries the run again from a count of zero.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from slurmft.db.models import ActionKind, ActionStatus, Run
from slurmft.db.records import finish_action, plan_action, record_control_error
from slurmft.db.states import RunState

log = logging.getLogger(__name__)

HOLD_AFTER = 3  # passes in a row
# The summary kept on the run (runs.control_error) for status and /healthz.
MAX_ERROR_CHARS = 500


@dataclass
class PassFailures:
    """The runs whose part of this pass failed, each with its first error of the pass."""

    errors: dict[str, str] = field(default_factory=dict)

    def add(self, run_id: str, stage: str, error: str) -> None:
        self.errors.setdefault(run_id, f"{stage}: {error}"[:MAX_ERROR_CHARS])

    def record(self, session: Session, run_id: str, stage: str, exc: BaseException) -> None:
        """A run's part failed with ``exc``: logged with its traceback, an event on the run
        (once per distinct error), and counted for this pass."""
        error = f"{type(exc).__name__}: {exc}"
        log.error(
            "run %s: %s failed: %s", run_id, stage, error, exc_info=exc, extra={"run_id": run_id}
        )
        record_control_error(session, run_id, stage, error)
        self.add(run_id, stage, error)


def is_held(run: Run) -> bool:
    return run.control_failures >= HOLD_AFTER


_LIVE = [state for state in RunState if not state.is_terminal]


def held_runs(session: Session) -> list[Run]:
    """The live runs held now (an ended run's hold is history)."""
    held = select(Run).where(Run.control_failures >= HOLD_AFTER, Run.state.in_(_LIVE))
    return list(session.scalars(held.order_by(Run.id)).all())


def count_held(session: Session) -> int:
    held = select(func.count()).select_from(Run)
    return session.scalar(held.where(Run.control_failures >= HOLD_AFTER, Run.state.in_(_LIVE))) or 0


def settle(session: Session, failures: PassFailures, tried: Collection[str]) -> list[str]:
    """After a pass: each run in ``tried`` (its part was attempted) counts one more failure in
    a row, or starts again from zero; a run that reaches HOLD_AFTER is held, with an action row
    saying why. Returns the runs held by this pass."""
    held: list[str] = []
    # The runs counting failures now: few, usually none; one query however many runs there are.
    counting = select(Run).where(Run.control_failures > 0, Run.control_failures < HOLD_AFTER)
    for counted in session.scalars(counting).all():
        if counted.id in tried and counted.id not in failures.errors:
            counted.control_failures, counted.control_error = 0, None
    for run_id, error in sorted(failures.errors.items()):
        run = session.get(Run, run_id)
        if run is None or is_held(run):
            continue
        run.control_failures += 1
        run.control_error = error
        if is_held(run):
            _hold(session, run, error)
            held.append(run_id)
    session.flush()
    return held


def _hold(session: Session, run: Run, error: str) -> None:
    reason = (
        f"held: its part of the control pass failed {run.control_failures} passes in a row "
        f"({error}); it is no longer tried, except a cancel. Mend the cause, then an admin "
        f"runs `slurmft release-run {run.id}`"
    )
    log.error("run %s %s", run.id, reason, extra={"run_id": run.id})
    row = plan_action(session, ActionKind.HOLD_RUN, reason, run_id=run.id)
    finish_action(row, ActionStatus.DONE)


def release(session: Session, run: Run, by: str) -> bool:
    """An admin releases a held run (or clears a count that is not a hold yet): the next pass
    tries it again. Recorded as an action with who asked; False when there was nothing to
    release."""
    if not run.control_failures:
        return False
    reason = f"released by {by} after {run.control_failures} failing passes ({run.control_error})"
    run.control_failures, run.control_error = 0, None
    row = plan_action(session, ActionKind.RELEASE_RUN, reason, run_id=run.id)
    finish_action(row, ActionStatus.DONE)
    return True
