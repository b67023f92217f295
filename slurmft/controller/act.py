"""Executes the policy's actions: thin effects, each one recorded with its reason and evidence.

Every effect is written as a ``planned`` action row first, committed before the effect runs,
and finished in a second transaction afterwards, so "why did this node get drained" is one
query, and a daemon killed (or a store failing) between the effect and its record leaves a
planned row that the next pass settles (slurmft.controller.intents): a job the action submitted
carries the action's id in its comment and is adopted, never submitted twice. In
observe-only mode every action is recorded as ``skipped`` and nothing is touched, except the
end of a run whose job has already ended by itself: that is the store's record of what Slurm
says (the run completed, or its batch step gave up), not an act on the cluster.

Commands for agents (leave the run, restart your workers) are not pushed: they are rows in the
store (the run-scoped denylist, planned ``restart_workers`` actions) that the ingest endpoint
puts into its reply when the agent next reports, so a daemon restart loses none of them.

"A person is needed" is a ``notify`` row too. With a webhook configured it stays ``planned``
until the webhook job has delivered it (an outbox: nothing is lost while the receiver is down
or the daemon restarts); without one it is ``done`` at once and shown by `slurmft status`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.controller import views as v
from slurmft.controller.intents import open_resubmitted_attempt
from slurmft.controller.resubmit import WAITING_FOR_OWNER, SubmissionError
from slurmft.db import Database, DatabaseUnavailable
from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    Event,
    EventKind,
    Run,
    utcnow,
)
from slurmft.db.records import OBSERVE_ONLY as OBSERVE_ONLY
from slurmft.db.records import (
    denylist_add,
    expire_planned_restarts,
    finish_action,
    named_by_own_evidence,
    plan_action,
    record_control_error,
    record_event,
)
from slurmft.db.states import RunState
from slurmft.errors import SlurmftError
from slurmft.slurm.api import SlurmClient, SlurmError, SlurmJobNotFound, SlurmPermissionDenied
from slurmft.slurm.names import check_node_name
from slurmft.slurm.script import not_the_runs_job, slurm_reason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    action: v.Action
    status: ActionStatus
    error: str | None = None
    # The action raised what nobody expected (a bug, bad data): its run's part of the pass
    # failed (controller.pass_health), not an effect Slurm refused.
    internal: bool = False


# The run's job submitted again, as its owner, these nodes excluded, tagged with the id of the
# action that submits it; returns the Slurm job id (slurmft.controller.resubmit.OwnerSubmitter).
# Raises SubmissionError when it cannot.
Submitter = Callable[[Run, frozenset[str], int], str]


class Executor:
    def __init__(
        self,
        database: Database,
        slurm: SlurmClient,
        *,
        observe_only: bool = False,
        submit_attempt: Submitter | None = None,
        webhook: bool = False,
    ) -> None:
        self._db = database
        self._slurm = slurm
        self._observe_only = observe_only
        self._submit_attempt = submit_attempt
        self._webhook = webhook  # notify rows wait in the outbox for the webhook job

    def execute(
        self,
        actions: Sequence[v.Action],
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> list[Outcome]:
        """Run the actions in order, one transaction each, so one failure stops nothing else.
        ``on_outcome`` is told of each outcome once its transaction committed: in-process
        metrics then agree with the store at every moment, not only after the whole pass."""
        outcomes = []
        for action in actions:
            try:
                outcome = self._execute_one(action)
            except DatabaseUnavailable:
                raise  # the store is gone: the pass ends here, for everyone, and is retried
            except Exception as exc:
                # A bug or bad data in this run's action (a malformed record, a value nobody
                # expected) before its intent was recorded: its transaction rolled back; it is
                # recorded as failed on its run, and the other runs' actions go on.
                _log_failure(action, exc)
                outcome = self._record_failure(action, exc)
            routine = isinstance(action, v.RecordRestarts) and action.progress_only
            log.log(
                logging.DEBUG if routine else logging.INFO,
                "%s %s: %s (%s)",
                type(action).__name__,
                outcome.status.value,
                action.reason,
                outcome.error or "ok",
                extra={"run_id": action.run_id, "node": getattr(action, "node", None)},
            )
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
        return outcomes

    def _execute_one(self, action: v.Action) -> Outcome:
        """The intent (a planned row) commits first; the effect runs and its outcome is
        recorded in a transaction of its own."""
        with self._db.session() as session:
            intent = self._intend(session, action)
        if isinstance(intent, Outcome):
            return intent
        try:
            with self._db.session() as session:
                return self._carry_out(session, action, intent)
        except DatabaseUnavailable:
            raise  # the row stays planned: the next pass settles it (controller.intents)
        except Exception as exc:
            _log_failure(action, exc)
            return self._fail_planned(action, intent, exc)

    def _fail_planned(self, action: v.Action, row_id: int, exc: Exception) -> Outcome:
        """The effect raised what nobody expected: its planned row fails with the error."""
        error = _internal_error(exc)
        with self._db.session() as session:
            row = session.get(Action, row_id)
            if row is not None and row.status is ActionStatus.PLANNED:
                finish_action(row, ActionStatus.FAILED, error=error)
        return Outcome(action, ActionStatus.FAILED, error, internal=True)

    def _record_failure(self, action: v.Action, exc: Exception) -> Outcome:
        """The action's row, failed with the error (an event row for a recording that failed),
        in a transaction of its own."""
        error = _internal_error(exc)
        key = action.evidence.get("key")
        # The evidence itself may be what failed (a value JSON cannot hold): then only its key.
        for evidence in (action.evidence, {"key": key} if isinstance(key, str) else {}):
            try:
                with self._db.session() as session:
                    self._record_failed_row(session, action, error, evidence)
                break
            except DatabaseUnavailable:
                raise
            except Exception:
                log.exception("could not record the failure of %s", type(action).__name__)
        return Outcome(action, ActionStatus.FAILED, error, internal=True)

    def _record_failed_row(
        self, session: Session, action: v.Action, error: str, evidence: dict[str, Any]
    ) -> None:
        if isinstance(action, v.RecordEvent | v.RecordRestarts):
            record_control_error(session, action.run_id, type(action).__name__, error)
            return
        kind, node, _ = self._plan(session, action)
        row = plan_action(
            session, kind, action.reason, run_id=action.run_id, node=node, evidence=evidence
        )
        finish_action(row, ActionStatus.FAILED, error=error)

    def expire_commands(self, now: datetime, ttl: timedelta) -> int:
        """Planned agent commands (restart your workers) not delivered within ``ttl`` are
        finished as skipped, "expired": a restart decided minutes ago is never done late, when
        the finding it answered may be long gone. Returns how many expired."""
        with self._db.session() as session:
            return expire_planned_restarts(session, older_than=now - ttl)

    def _intend(self, session: Session, action: v.Action) -> Outcome | int:
        """Record the action: its outcome when recording is all there is to it, else the id
        of its planned row, whose effect is still to run."""
        if isinstance(action, v.RecordRestarts):
            _record_restarts(session, action)  # the budget's bookkeeping: observing too
            return Outcome(action, ActionStatus.DONE)
        if isinstance(action, v.RecordEvent):
            # Recording is observing, not acting: done in observe-only mode too.
            record_event(
                session,
                action.kind,
                action.reason,
                run_id=action.run_id,
                node=action.node,
                rank=action.rank,
                fault_class=action.fault_class,
                details={**action.evidence, "key": action.key},
            )
            return Outcome(action, ActionStatus.DONE)
        kind, node, effect = self._plan(session, action)
        observe_only = self._observe_only and not _records_an_end(action)
        if observe_only and _skipped_before(session, kind, node, action):
            # Nothing changes when nothing is done: the same decision comes every pass.
            return Outcome(action, ActionStatus.SKIPPED, OBSERVE_ONLY)
        evidence = _evidence(action)
        row = plan_action(
            session, kind, action.reason, run_id=action.run_id, node=node, evidence=evidence
        )
        if observe_only:
            finish_action(row, ActionStatus.SKIPPED, error=OBSERVE_ONLY)
            return Outcome(action, ActionStatus.SKIPPED, OBSERVE_ONLY)
        if effect is None:  # delivered to the agent with its next report
            return Outcome(action, ActionStatus.PLANNED)
        if kind is ActionKind.NOTIFY and self._webhook:
            return Outcome(action, ActionStatus.PLANNED)  # the webhook job delivers it
        return row.id

    def _carry_out(self, session: Session, action: v.Action, row_id: int) -> Outcome:
        row = session.get(Action, row_id)
        if row is None or row.status is not ActionStatus.PLANNED:
            raise RuntimeError(f"action {row_id} is no longer planned")
        kind, _, effect = self._plan(session, action, row)
        assert effect is not None  # _intend returned a row id only for an effect
        try:
            effect()
        except (SlurmPermissionDenied, SubmissionError, NotTheRunsJob, NotTheRunsNode) as exc:
            # Not an error to retry: this daemon may not do it. A person has to.
            error = (
                f"drain requested, not permitted: {exc}"
                if kind is ActionKind.DRAIN_NODE and not isinstance(exc, NotTheRunsNode)
                else str(exc)
            )
            finish_action(row, ActionStatus.SKIPPED, error=error)
            self._notify(session, action, f"{action.reason}: {error}")
            return Outcome(action, ActionStatus.SKIPPED, error)
        except SlurmError as exc:
            finish_action(row, ActionStatus.FAILED, error=str(exc))
            return Outcome(action, ActionStatus.FAILED, str(exc))
        finish_action(row, ActionStatus.DONE)
        return Outcome(action, ActionStatus.DONE)

    def _plan(
        self, session: Session, action: v.Action, row: Action | None = None
    ) -> tuple[ActionKind, str | None, Callable[[], None] | None]:
        """The action's kind, its node, and its effect (None: an agent command, or recorded
        only); ``row`` is the action's planned row, once there is one."""
        match action:
            case v.ExcludeNode(node=node):
                # The run-scoped denylist entry is the command: the agent reads it as "leave".
                return ActionKind.AGENT_LEAVE, node, lambda: _deny_for_run(session, action, node)
            case v.DrainNode(node=node):

                def drain() -> None:
                    # Slurm first: a drain this daemon may not do (or Slurm refuses) leaves no
                    # global denylist entry behind, only its skipped or failed row. Slurm gets
                    # the reason cut to its limit; the action row keeps it whole. And only a node
                    # the run's own evidence names: never one another run's agents posted about.
                    check_node_name(node)  # refused before Slurm, or the denylist, sees it
                    if not named_by_own_evidence(session, node, action.run_id):
                        raise NotTheRunsNode(f"no evidence of run {action.run_id} names {node}")
                    self._slurm.drain(node, slurm_reason(action.reason))
                    denylist_add(session, node, action.reason)

                return ActionKind.DRAIN_NODE, node, drain
            case v.EvictNode(node=node):
                # DOWN takes the node out of a running --no-kill job (docs/slurm.md).
                return (
                    ActionKind.EVICT_NODE,
                    node,
                    lambda: self._slurm.down(check_node_name(node), slurm_reason(action.reason)),
                )
            case v.RestartWorkers(node=node):
                return ActionKind.RESTART_WORKERS, node, None
            case v.RequeueJob(job_id=requeued, exclude=exclude):

                def requeue() -> None:
                    self._check_job_is_the_runs(session, action, requeued)
                    # ExcNodeList can only change while the job waits: the client sets it as
                    # the requeued job completes, and decide again while it waits.
                    self._slurm.requeue(requeued, exclude=sorted(exclude))

                return ActionKind.REQUEUE, None, requeue
            case v.ExcludeFromJob(job_id=waiting, nodes=nodes):

                def exclude_nodes() -> None:
                    self._check_job_is_the_runs(session, action, waiting)
                    self._slurm.set_excluded_nodes(waiting, sorted(nodes))

                return ActionKind.EXCLUDE_NODES, None, exclude_nodes
            case v.SubmitAttempt(exclude=exclude):
                return (
                    ActionKind.RESUBMIT,
                    None,
                    lambda: self._resubmit(session, action, exclude, row),
                )
            case v.FinishRun(state=state, job_id=job_id):
                kind = {
                    RunState.STOPPED: ActionKind.STOP_RUN,
                    RunState.CANCELLED: ActionKind.CANCEL,
                }.get(state, ActionKind.FINISH_RUN)
                return kind, None, lambda: self._finish(session, action, state, job_id)
            case v.NotifyHuman():
                return ActionKind.NOTIFY, None, _recorded_only
        raise TypeError(f"no executor for {type(action).__name__}")

    def _resubmit(
        self, session: Session, action: v.Action, exclude: frozenset[str], row: Action | None
    ) -> None:
        if self._submit_attempt is None:
            raise SubmissionError(f"this daemon does not submit jobs; {WAITING_FOR_OWNER}")
        if row is None:
            raise RuntimeError("a resubmission runs only after its intent is recorded")
        run = session.get(Run, action.run_id)
        if run is None or run.state.is_terminal:
            return
        job_id = self._submit_attempt(run, exclude, row.id)
        # Charged once the new job exists: a failed sbatch is decided (and charged) again later.
        if isinstance(action, v.SubmitAttempt) and action.restarts_without_progress is not None:
            run.restarts_without_progress = action.restarts_without_progress
        open_resubmitted_attempt(session, run, row, job_id)

    def _notify(self, session: Session, action: v.Action, reason: str) -> None:
        """A person is needed because this daemon could not act (see the module docstring)."""
        row = plan_action(
            session, ActionKind.NOTIFY, reason, run_id=action.run_id, evidence=action.evidence
        )
        if not self._webhook:
            finish_action(row, ActionStatus.DONE)

    def _check_job_is_the_runs(self, session: Session, action: v.Action, job_id: str) -> None:
        """Slurm's record of the job, not the store's, says whose it is: the daemon cancels or
        requeues it with its own rights only when it is the run owner's and tagged with the
        run (slurmft.slurm.script.not_the_runs_job); raises NotTheRunsJob otherwise."""
        run = session.get(Run, action.run_id)
        if run is None:
            raise NotTheRunsJob(f"job {job_id}: no run {action.run_id} in the store")
        problem = not_the_runs_job(self._slurm.job(job_id), run.id, run.owner_uid)
        if problem is not None:
            raise NotTheRunsJob(f"not touched: {problem}")

    def _cancel(self, session: Session, action: v.Action, job_id: str) -> None:
        try:
            self._check_job_is_the_runs(session, action, job_id)
        except SlurmJobNotFound:
            return  # gone from Slurm already: nothing left to cancel
        self._slurm.cancel(job_id)

    def _finish(
        self, session: Session, action: v.Action, state: RunState, job_id: str | None
    ) -> None:
        reason = action.reason
        if job_id is not None:
            try:
                self._cancel(session, action, job_id)
            except NotTheRunsJob as exc:
                # The run ends as decided; the job that is not its own is left alone.
                reason = f"{action.reason} (job {job_id} {exc})"
                self._notify(session, action, reason)
        run = session.get(Run, action.run_id)
        if run is not None and not run.state.is_terminal:
            run.state = state
            run.end_reason = reason
            run.ended_at = utcnow()  # the run's wall time ends here (run_effective_time)


class NotTheRunsJob(SlurmftError):
    """Slurm says the job a run's action names is not that run's (another owner, another
    run's comment): the daemon does not touch it, and a person is told."""


class NotTheRunsNode(SlurmftError):
    """A drain names a node that no evidence of the run's own (an event judged not foreign)
    names: the daemon does not drain it, and a person is told."""


def _skipped_before(session: Session, kind: ActionKind, node: str | None, action: v.Action) -> bool:
    """This very decision (run, kind, node, reason) was recorded as skipped already."""
    found = session.scalars(
        select(Action.id)
        .where(
            Action.run_id == action.run_id if action.run_id else Action.run_id.is_(None),
            Action.kind == kind,
            Action.node == node if node else Action.node.is_(None),
            Action.reason == action.reason,
            Action.status == ActionStatus.SKIPPED,
        )
        .limit(1)
    ).first()
    return found is not None


def _log_failure(action: v.Action, exc: Exception) -> None:
    log.exception(
        "%s of run %s failed: %s",
        type(action).__name__,
        action.run_id,
        exc,
        extra={"run_id": action.run_id},
    )


def _internal_error(exc: Exception) -> str:
    return f"internal error: {type(exc).__name__}: {exc}"


def _evidence(action: v.Action) -> dict[str, object]:
    """The row's evidence; a resubmission's also carries the count it charges once its job
    exists, so that a job adopted after an interruption is charged as one recorded at once."""
    if isinstance(action, v.SubmitAttempt) and action.restarts_without_progress is not None:
        return {**action.evidence, "restarts_without_progress": action.restarts_without_progress}
    return dict(action.evidence)


def _records_an_end(action: v.Action) -> bool:
    """A run's end after its job ended: nothing to cancel, only the store to update."""
    return isinstance(action, v.FinishRun) and action.job_id is None


def _deny_for_run(session: Session, action: v.Action, node: str) -> None:
    denylist_add(session, node, action.reason, run_id=action.run_id)


def _record_restarts(session: Session, action: v.RecordRestarts) -> None:
    """The run's count, and one `restart` event of the daemon's per restart counted, with its
    cause: what the `run_restarts` view counts (the agents' reports of it, one per node, are
    its evidence). A restart is counted at its first report, often before the node loss that
    caused it is known (Slurm takes seconds to call a node DOWN), so a recorded cause is
    corrected later."""
    run = session.get(Run, action.run_id)
    if run is None or run.state.is_terminal:
        return
    run.restarts_without_progress = action.restarts_without_progress
    run.last_progress_at = action.last_progress_at
    if not action.restarts:
        return
    recorded = {
        event.details.get("restart_key"): event
        for event in session.scalars(
            select(Event).where(
                Event.run_id == run.id, Event.kind == EventKind.RESTART, Event.source == "daemon"
            )
        )
        if isinstance(event.details, dict)
    }
    for restart in action.restarts:
        free = ", free: its node left the run" if restart.node_removed else ""
        message = f"workers restarted ({restart.cause.value}{free})"
        details = {"restart_key": restart.key, "free": restart.node_removed}
        event = recorded.get(restart.key)
        if event is None:
            record_event(
                session,
                EventKind.RESTART,
                message,
                run_id=run.id,
                fault_class=restart.cause,
                details=details,
                occurred_at=restart.at,
            )
        else:
            event.fault_class, event.message, event.details = restart.cause, message, details


def _recorded_only() -> None:
    """Effects that live in the store (denylist, outbox): the action row is the whole effect."""
