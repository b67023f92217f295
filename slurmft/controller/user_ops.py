"""What users may ask the daemon over the unix socket, scoped to the caller's uid.

A user sees and acts on their own runs only; an admin (root, or a member of
``daemon.admin_group``: slurmft.controller.admins) sees and may cancel all. A run that exists
but belongs to someone else gets the same answer as one that does not exist.
"""

from __future__ import annotations

import pwd
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from slurmft.config import DaemonSection, PolicySection, TrustSection
from slurmft.controller import pass_health, run_status
from slurmft.controller.admins import ROOT_ONLY, Admins
from slurmft.controller.history_ops import history_operations
from slurmft.controller.ingest import new_run_token, record_refusal
from slurmft.controller.limits import AuditThrottle
from slurmft.controller.node_ops import NodeOps
from slurmft.controller.resubmit import SubmissionError, check_record
from slurmft.controller.rpc import Operation, RpcError
from slurmft.controller.run_status import latest_attempt
from slurmft.controller.spec import RunSpec
from slurmft.controller.timeline import MAX_ENTRIES, Cursor, read_timeline
from slurmft.controller.visibility import visible_run
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, Attempt, Run, utcnow
from slurmft.db.records import denied_nodes
from slurmft.db.states import RunState
from slurmft.slurm.api import SlurmClient, SlurmError, SlurmJobNotFound
from slurmft.slurm.commands import is_job_id
from slurmft.slurm.script import not_the_runs_job


def _action_row(action: Action) -> dict[str, Any]:
    return {
        "at": action.created_at.isoformat(),
        "kind": action.kind.value,
        "node": action.node,
        "status": action.status.value,
        "reason": action.reason,
        "error": action.error,
    }


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _submission_arg(args: Mapping[str, Any]) -> dict[str, Any] | None:
    """The job as the client sent it to sbatch (optional), checked before it is stored."""
    submission = args.get("submission")
    if submission is None:
        return None
    try:
        return check_record(submission)
    except SubmissionError as exc:
        raise RpcError(str(exc)) from None


def _slurm_says_is_the_runs(slurm: SlurmClient, job_id: str, run: Run) -> None:
    """The daemon acts on a run's job with its own rights: a job id a user names becomes the
    run's only when Slurm says the user submitted it for this run (owner and comment)."""
    try:
        job = slurm.job(job_id)
    except SlurmJobNotFound:
        raise RpcError(f"Slurm has no job {job_id}") from None
    except SlurmError as exc:
        raise RpcError(
            f"cannot check job {job_id} with Slurm ({exc}); nothing was attached, try again"
        ) from None
    problem = not_the_runs_job(job, run.id, run.owner_uid)
    if problem is not None:
        raise RpcError(f"job {job_id} is not run {run.id}'s: {problem}")


def _attach_job(
    database: Database, slurm: SlurmClient, uid: int, args: Mapping[str, Any], admins: Admins
) -> dict[str, Any]:
    """The job `slurmft submit` made for a run becomes its next attempt, once Slurm confirms
    it is the caller's job for that run."""
    job_id = args.get("job_id")
    if not isinstance(job_id, str) or not job_id.strip():
        raise RpcError("a Slurm job id is required")
    job_id = job_id.strip()
    if not is_job_id(job_id):  # stored, it would be asked of Slurm on every control pass
        raise RpcError(f"not a Slurm job id: {job_id!r} (e.g. 1234, or 1234_5 for an array task)")
    submission = _submission_arg(args)
    with database.session() as session:
        claimed = visible_run(session, uid, args.get("run_id"), admins)
    _slurm_says_is_the_runs(slurm, job_id, claimed)  # outside a transaction: Slurm may be slow
    with database.session() as session:
        run = visible_run(session, uid, claimed.id, admins)
        number = (latest_attempt(session, run.id) or Attempt(number=0)).number + 1
        session.add(Attempt(run_id=run.id, number=number, slurm_job_id=job_id))
        if submission is not None:  # what a resubmission sends again (controller.resubmit)
            run.submission = submission
        return {"run_id": run.id, "attempt": number, "job_id": job_id}


def release_held_run(
    database: Database, admins: Admins, uid: int, args: Mapping[str, Any]
) -> dict[str, Any]:
    """An admin releases a run held by the control pass (controller.pass_health): the next
    pass tries its part again. Recorded as an action naming the admin."""
    if uid not in admins:
        raise RpcError("only an admin (root, or daemon.admin_group) may release a held run")
    with database.session() as session:
        run = visible_run(session, uid, args.get("run_id"), admins)
        failures, error = run.control_failures, run.control_error
        released = pass_health.release(session, run, _user_name(uid))
        return {"run_id": run.id, "released": released, "failures": failures, "error": error}


@dataclass(frozen=True)
class RunQuota:
    """Runs one user may have pending or running at once (0: no quota); root and ``exempt``
    (user names) are not counted against it."""

    max_active: int = DaemonSection.max_active_runs_per_user
    exempt: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, daemon: DaemonSection) -> RunQuota:
        names = (name.strip() for name in daemon.quota_exempt_users.split(","))
        return cls(daemon.max_active_runs_per_user, frozenset(name for name in names if name))


_ACTIVE_STATES = [state for state in RunState if not state.is_terminal]


def _over_quota(session: Session, quota: RunQuota, uid: int, user: str) -> str | None:
    """Why ``user`` may not have one more run, if they may not."""
    if quota.max_active <= 0 or uid == 0 or user in quota.exempt:  # root
        return None
    active = session.scalar(
        select(func.count())
        .select_from(Run)
        .where(Run.owner_uid == uid, Run.state.in_(_ACTIVE_STATES))
    )
    if (active or 0) < quota.max_active:
        return None
    return (
        f"run quota: {user} has {active} runs pending or running, the most "
        f"daemon.max_active_runs_per_user ({quota.max_active}) allows; cancel one "
        "(`slurmft cancel RUN`) or wait for one to end"
    )


class _Quota:
    """The run quota, and what it does with a refusal: counts it (a metric) and records it
    (an action naming the user, at most once a minute per user)."""

    def __init__(self, quota: RunQuota, on_refusal: Callable[[str], None]) -> None:
        self.quota, self.on_refusal = quota, on_refusal
        self.audit = AuditThrottle()


def _create_run(
    database: Database,
    uid: int,
    args: Mapping[str, Any],
    agents: tuple[str, str],
    quota: _Quota,
) -> dict[str, Any]:
    """A new run for ``uid``, within their quota; ``agents``: the URL its agents report to and
    the CA file they verify it against."""
    controller_url, ca_file = agents
    spec = RunSpec.from_dict(dict(args.get("spec") or {}))
    token, digest = new_run_token()
    user = _user_name(uid)
    with database.session() as session:
        over = _over_quota(session, quota.quota, uid, user)
        if over is None:
            run = Run(
                name=spec.name,
                owner_uid=uid,
                owner_name=user,
                nodes=spec.nodes,
                spares=spec.spares,
                command=list(spec.script),
                spec=spec.to_dict(),
                checkpoint_dir=spec.ckpt_dir,
                token_hash=digest,
            )
            session.add(run)
            session.flush()
            return {
                "run_id": run.id,
                "token": token,
                "controller_url": controller_url,
                "ca_file": ca_file,
                "exclude": sorted(denied_nodes(session)),
            }
    quota.on_refusal("run_quota")
    if quota.audit.due("run_quota", str(uid), time.monotonic()):
        with database.session() as session:  # its own transaction: the refusal is kept
            record_refusal(session, over, user=user, limit="run_quota")
    raise RpcError(over)


def job_logs(run: Run) -> list[dict[str, Any]]:
    """Where each attempt's job output is: the `--output` the run's job was submitted with
    (`<ckpt>/.slurmft/slurm-%j.out` by default), for its job id. The daemon names the file; the
    caller reads it with their own rights (`slurmft logs`), never the daemon for them."""
    record = run.submission or {}
    pattern = record.get("output") if isinstance(record.get("output"), str) else None
    if pattern is None and run.checkpoint_dir:
        pattern = str(Path(run.checkpoint_dir) / ".slurmft" / "slurm-%j.out")
    return [
        {
            "attempt": attempt.number,
            "job_id": attempt.slurm_job_id,
            "slurm_restarts": attempt.slurm_restarts,
            "state": attempt.state.value,
            "started_at": attempt.started_at.isoformat() if attempt.started_at else None,
            "path": pattern.replace("%j", attempt.slurm_job_id)
            if pattern and attempt.slurm_job_id
            else None,
        }
        for attempt in run.attempts
    ]


def _runs_query(uid: int, args: Mapping[str, Any], admins: Admins) -> Select[Run]:
    """The runs `slurmft runs` lists, newest first: the caller's own (an admin's: everyone's,
    or ``user``'s), in the ``states`` asked for, created since ``since`` (ISO 8601)."""
    query = select(Run).order_by(Run.created_at.desc())
    user = args.get("user")
    if user is not None and not isinstance(user, str):
        raise RpcError("user must be a user name")
    if uid not in admins:
        if user is not None and user != _user_name(uid):
            raise RpcError("only an admin may list another user's runs")
        query = query.where(Run.owner_uid == uid)
    elif user is not None:
        query = query.where(Run.owner_name == user)
    states = args.get("states") or []
    known = {state.value for state in RunState}
    if not isinstance(states, list) or not all(s in known for s in states):
        raise RpcError(f"states must be among: {', '.join(sorted(known))}")
    if states:
        query = query.where(Run.state.in_([RunState(s) for s in states]))
    since = args.get("since")
    if since is not None:
        try:
            when = datetime.fromisoformat(str(since))
        except ValueError:
            raise RpcError(f"since: not an ISO 8601 time: {since!r}") from None
        query = query.where(Run.created_at >= (when if when.tzinfo else when.replace(tzinfo=UTC)))
    limit = args.get("limit", 200)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_ENTRIES:
        raise RpcError(f"limit must be a positive whole number, at most {MAX_ENTRIES}")
    return query.limit(limit)


def operations(
    database: Database,
    *,
    slurm: SlurmClient,
    controller_url: str = "",
    admins: Admins = ROOT_ONLY,
    ca_file: str = "",
    quota: RunQuota | None = None,
    on_refusal: Callable[[str], None] | None = None,
    lemon_min_runs: int = TrustSection.lemon_min_runs,
    restart_cap: int = PolicySection.max_restarts_without_progress,
) -> dict[str, Operation]:
    """The daemon's user-facing operations, bound to its store, to Slurm (to check what users
    claim about jobs), to who its admins are and, for new runs, to the URL its agents report
    to (and the CA file they verify an https URL against). ``quota`` bounds each user's runs;
    ``on_refusal`` counts what it refuses (a metric); ``restart_cap``: the daemon's
    policy.max_restarts_without_progress, which `status` shows restarts against."""
    run_quota = _Quota(quota or RunQuota(), on_refusal or (lambda _limit: None))

    def create_run(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        return _create_run(database, uid, args, (controller_url, ca_file), run_quota)

    def attach_job(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        return _attach_job(database, slurm, uid, args, admins)

    def fail_run(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        with database.session() as session:
            run = visible_run(session, uid, args.get("run_id"), admins)
            if run.state is RunState.PENDING:
                run.state = RunState.FAILED
                run.end_reason = str(args.get("reason") or "submission failed")[:2000]
                run.ended_at = utcnow()
            return {"run_id": run.id, "state": run.state.value}

    def runs(uid: int, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        query = _runs_query(uid, args, admins)
        with database.session() as session:
            now = utcnow()
            return [
                run_status.summary(session, run, now, restart_cap)
                for run in session.scalars(query)
            ]

    def status(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        with database.session() as session:
            run = visible_run(session, uid, args.get("run_id"), admins)
            recent = session.scalars(
                select(Action).where(Action.run_id == run.id).order_by(Action.id.desc()).limit(10)
            ).all()
            notices = session.scalars(
                select(Action)
                .where(Action.run_id == run.id, Action.kind == ActionKind.NOTIFY)
                .order_by(Action.id.desc())
                .limit(5)
            ).all()
            return {
                **run_status.status(session, run, utcnow(), restart_cap),
                "excluded_nodes": sorted(denied_nodes(session, run_id=run.id)),
                "recent_actions": [_action_row(a) for a in reversed(recent)],
                "human_needed": [_action_row(a) for a in reversed(notices)],
            }

    def events(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        limit = args.get("limit", 100)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_ENTRIES:
            raise RpcError(f"limit must be a positive whole number, at most {MAX_ENTRIES}")
        try:
            cursor = args.get("cursor")
            after = None if cursor is None else Cursor.from_json(cursor)
        except ValueError as exc:
            raise RpcError(str(exc)) from None
        with database.session() as session:
            run = visible_run(session, uid, args.get("run_id"), admins)
            told = read_timeline(session, run.id, limit=limit, after=after)
            return {
                "run_id": run.id,
                "state": run.state.value,
                "entries": [entry.to_json() for entry in told.entries],
                "cursor": told.cursor.to_json(),
                "truncated": told.truncated,
            }

    def log_files(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        with database.session() as session:
            run = visible_run(session, uid, args.get("run_id"), admins)
            return {"run_id": run.id, "owner": run.owner_name, "attempts": job_logs(run)}

    def cancel(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        with database.session() as session:
            run = visible_run(session, uid, args.get("run_id"), admins)
            if run.state.is_terminal:
                raise RpcError(f"run {run.id} already ended ({run.state.value})")
            if run.cancel_requested_at is None:
                run.cancel_requested_at = utcnow()
            return {"run_id": run.id, "cancel_requested": True}

    nodes = NodeOps(database, slurm, admins, lemon_min_runs, _user_name)
    return {
        "runs": runs,
        "status": status,
        "events": events,
        "cancel": cancel,
        "log_files": log_files,
        "create_run": create_run,
        "attach_job": attach_job,
        "fail_run": fail_run,
        "release_run": partial(release_held_run, database, admins),
        **nodes.operations(),
        **history_operations(database, admins),
    }
