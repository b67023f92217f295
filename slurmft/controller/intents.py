"""Effects whose intent was recorded and whose outcome was not: settled before a pass decides.

The executor (slurmft.controller.act) commits an action's ``planned`` row before it runs the
effect and records the outcome in a second transaction. A daemon killed between the two, or a
store that fails at the second commit, leaves the row planned. Passes never overlap
(``max_instances=1``) and only the control pass runs effects, so at the start of a pass every
planned row of an effect that runs inline was interrupted. Each is settled from what Slurm says:

- a resubmission: the job it submitted carries the action's id in its comment
  (`slurmft-action:<id>`, slurmft.slurm.script). Found among the owner's jobs, it is adopted
  (the attempt is opened and the row is ``done`` with the job's id), so the run never gets two
  jobs for one attempt. Not found: sbatch never submitted it (or the job ended and slurmctld
  purged it, MinJobAge later), and the row fails, so the pass decides again.
- any other effect (drain, requeue, cancel, ...) fails as interrupted; the pass decides again
  from Slurm's view, and each of those effects is safe to repeat.

Commands for agents (``restart_workers``) and notices waiting for the webhook stay planned by
design and are not touched here.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.db.models import Action, ActionKind, ActionStatus, Attempt, Run, utcnow
from slurmft.db.records import finish_action
from slurmft.db.states import AttemptState, RunState
from slurmft.slurm.api import JobInfo, SlurmClient
from slurmft.slurm.script import action_id_from_comment, run_id_from_comment

log = logging.getLogger(__name__)

# The effects the executor runs in the pass itself (the rest are delivered later, by design).
INLINE_EFFECTS = frozenset(
    {
        ActionKind.DRAIN_NODE,
        ActionKind.EVICT_NODE,
        ActionKind.AGENT_LEAVE,
        ActionKind.REQUEUE,
        ActionKind.EXCLUDE_NODES,
        ActionKind.RESUBMIT,
        ActionKind.CANCEL,
        ActionKind.STOP_RUN,
        ActionKind.FINISH_RUN,
    }
)
INTERRUPTED = (
    "interrupted: the daemon stopped, or its store failed, before it recorded the outcome; "
    "decided again from what Slurm says now"
)
NOT_SUBMITTED = (
    "interrupted before sbatch answered, and no job of the owner carries this action's tag: "
    "decided again"
)
# The errors of rows settled here: the decision they carried is made again at once (observe).
UNFINISHED = (INTERRUPTED, NOT_SUBMITTED)


def open_resubmitted_attempt(session: Session, run: Run, row: Action, job_id: str) -> None:
    """The run's next attempt is the job ``row`` (a resubmission) submitted."""
    latest = session.scalars(
        select(Attempt.number).where(Attempt.run_id == run.id).order_by(Attempt.number.desc())
    ).first()
    session.add(
        Attempt(
            run_id=run.id,
            number=(latest or 0) + 1,
            slurm_job_id=job_id,
            state=AttemptState.SUBMITTED,
            submitted_at=utcnow(),
        )
    )
    if run.state is RunState.RUNNING:
        run.state = RunState.RECOVERING
    row.evidence = {**row.evidence, "slurm_job_id": job_id}


def settle_interrupted(session: Session, slurm: SlurmClient) -> int:
    """Settle every interrupted effect (module docstring); returns how many. Raises Slurm's
    errors when it cannot ask (the pass is then skipped: nothing is decided blind)."""
    rows = session.scalars(
        select(Action)
        .where(Action.status == ActionStatus.PLANNED, Action.kind.in_(INLINE_EFFECTS))
        .order_by(Action.id)
    ).all()
    if not rows:
        return 0
    tagged = _tagged_jobs(session, slurm, [r for r in rows if r.kind is ActionKind.RESUBMIT])
    for row in rows:
        job = tagged.get(row.id)
        if job is not None:
            _adopt(session, row, job)
        else:
            error = NOT_SUBMITTED if row.kind is ActionKind.RESUBMIT else INTERRUPTED
            finish_action(row, ActionStatus.FAILED, error=error)
            log.warning("action %d (%s) %s", row.id, row.kind.value, error)
    return len(rows)


def _tagged_jobs(session: Session, slurm: SlurmClient, rows: list[Action]) -> dict[int, JobInfo]:
    """The job each resubmission submitted, found by its tag among its run owner's jobs."""
    wanted = {row.id: row.run_id for row in rows}
    owners = {
        run.owner_uid
        for run in session.scalars(select(Run).where(Run.id.in_(set(wanted.values()))))
    }
    found: dict[int, JobInfo] = {}
    for uid in sorted(owners):
        for job in slurm.jobs_of_user(uid).values():
            action_id = action_id_from_comment(job.comment)
            if action_id in wanted and run_id_from_comment(job.comment) == wanted[action_id]:
                found[action_id] = job
    return found


def _adopt(session: Session, row: Action, job: JobInfo) -> None:
    run = session.get(Run, row.run_id)
    known = session.scalars(
        select(Attempt.id).where(Attempt.run_id == row.run_id, Attempt.slurm_job_id == job.job_id)
    ).first()
    if run is not None and not run.state.is_terminal and known is None:
        charged = row.evidence.get("restarts_without_progress")
        if isinstance(charged, int) and not isinstance(charged, bool):
            run.restarts_without_progress = charged  # charged once the job exists, as in act
        open_resubmitted_attempt(session, run, row, job.job_id)
    row.evidence = {**row.evidence, "slurm_job_id": job.job_id, "adopted": True}
    finish_action(row, ActionStatus.DONE)
    log.warning(
        "action %d: adopted job %s, which it submitted before the daemon recorded it",
        row.id,
        job.job_id,
        extra={"run_id": row.run_id},
    )
