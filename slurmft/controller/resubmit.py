"""Resubmitting a run's job as its owner, when Slurm can no longer requeue it.

A job that ended on its time limit, or that preemption cancelled (Slurm ignores ``--requeue``
under ``PreemptMode=CANCEL``), is gone: the run continues as a new job. That job must be the
same one `slurmft submit` sent (its script carries the user's slurmft, environment and token
file), and it must belong to the run's owner, not to the daemon. So:

- `slurmft submit` records what it sent to sbatch (``submission_record``) with the run;
- the daemon submits that record again, with today's excluded nodes, as the owner: directly
  when it runs as the owner (a per-user daemon), through a child process with the owner's uid,
  gid and groups when it runs as root, and not at all otherwise: the action is then recorded as
  waiting for the owner and a human is told.

sbatch passes its environment into the job (``--export=ALL``), so the owner's sbatch gets a
clean one (the owner's HOME/USER/SHELL, the PATH recorded at submit, SLURM_CONF), never the
daemon's own (which may hold the store's password).
"""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, replace
from typing import TYPE_CHECKING, Any

from slurmft.slurm import CliSlurmClient
from slurmft.slurm.api import SlurmError, SubmitRequest
from slurmft.slurm.runner import CommandResult

if TYPE_CHECKING:
    from slurmft.db.models import Run

ROOT_UID = 0
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
WAITING_FOR_OWNER = "waiting for the owner"


class SubmissionError(SlurmError):
    """The run's job cannot be submitted again by this daemon; a person must do it."""


def submission_record(request: SubmitRequest, *, workdir: str, path: str) -> dict[str, Any]:
    """What `slurmft submit` sent to sbatch, as JSON for the store (excluded nodes are not
    kept: a resubmission excludes the denylist of its own day)."""
    record = asdict(request)
    record["exclude"] = []
    del record["action_id"]  # each resubmission is tagged with its own action
    record["workdir"] = request.workdir or workdir
    record["path"] = path
    return record


# The type each recorded field must have (None allowed where the field is optional).
_RECORD_TYPES: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "script": (str, False),
    "job_name": (str, False),
    "run_id": (str, False),
    "nodes": (int, False),
    "spare_nodes": (int, False),
    "no_kill": (bool, False),
    "requeue": (bool, False),
    "exclude": ((list, tuple), False),
    "signal": (str, True),
    "time_limit": (str, True),
    "partition": (str, True),
    "ntasks_per_node": (int, True),
    "cpus_per_task": (int, True),
    "output": (str, True),
    "workdir": (str, True),
}


def _check_types(record: Mapping[str, Any]) -> None:
    """A field of the wrong type (``"nodes": "2"``) is refused here, with its name, rather than
    failing deep inside sbatch's argv."""
    for name, value in record.items():
        if name not in _RECORD_TYPES:
            continue
        wanted, optional = _RECORD_TYPES[name]
        if value is None and optional:
            continue
        is_bool = isinstance(value, bool)
        if not isinstance(value, wanted) or (is_bool and wanted is not bool):
            expected = wanted.__name__ if isinstance(wanted, type) else "a list"
            raise SubmissionError(
                f"the recorded submission's {name!r} is {type(value).__name__} {value!r}, "
                f"expected {expected}"
            )


def request_from_record(record: Mapping[str, Any], exclude: Sequence[str]) -> SubmitRequest:
    """The recorded job with these nodes excluded; a malformed record raises SubmissionError."""
    known = {f.name for f in fields(SubmitRequest)} - {"action_id"}  # never the record's
    _check_types(record)
    try:
        request = SubmitRequest(**{k: v for k, v in record.items() if k in known})
    except TypeError as exc:
        raise SubmissionError(f"the recorded submission is incomplete: {exc}") from None
    if not isinstance(request.script, str) or not request.script.startswith("#!"):
        raise SubmissionError("the recorded submission has no batch script")
    return replace(request, exclude=tuple(sorted(exclude)))


def check_record(record: object) -> dict[str, Any]:
    """A submission record as sent by a client, checked before it is stored."""
    if not isinstance(record, dict):
        raise SubmissionError("a submission record is a JSON object")
    request_from_record(record, ())
    return record


class OwnerRunner:
    """Runs the Slurm commands for the run's owner: in a clean environment and the submit-time
    working directory, and under the owner's uid, gid and groups when ``switch_user`` (the
    daemon is root)."""

    def __init__(
        self, owner: pwd.struct_passwd, env: Mapping[str, str], workdir: str, *, switch_user: bool
    ) -> None:
        self._owner = owner
        self._env = dict(env)
        self._workdir = workdir
        self._switch_user = switch_user

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        owner = self._owner
        identity: dict[str, Any] = {}
        if self._switch_user:
            identity = {
                "user": owner.pw_uid,
                "group": owner.pw_gid,
                "extra_groups": os.getgrouplist(owner.pw_name, owner.pw_gid),
            }
        try:
            completed = subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env=self._env,
                cwd=self._workdir,
                **identity,
            )
        except subprocess.TimeoutExpired as error:
            raise SubmissionError(
                f"{argv[0]} as {owner.pw_name} did not answer within {timeout:g} s", argv=argv
            ) from error
        except OSError as error:  # no such directory, not permitted, not installed
            raise SubmissionError(
                f"could not run {argv[0]} as {owner.pw_name} in {self._workdir}: {error}",
                argv=argv,
            ) from error
        return CommandResult(tuple(argv), completed.returncode, completed.stdout, completed.stderr)


class OwnerSubmitter:
    """The executor's ``submit_attempt``: the run's recorded job again, as the run's owner."""

    def __init__(
        self, *, slurm_conf: str | None, timeout_s: float, daemon_uid: int | None = None
    ) -> None:
        self._slurm_conf = slurm_conf
        self._timeout_s = timeout_s
        self._uid = os.geteuid() if daemon_uid is None else daemon_uid

    def __call__(self, run: Run, exclude: frozenset[str], action_id: int) -> str:
        if run.submission is None:
            raise SubmissionError(
                f"no submission is recorded for run {run.id} (submitted before slurmft kept "
                f"them?); {WAITING_FOR_OWNER} to submit it again"
            )
        request = replace(request_from_record(run.submission, sorted(exclude)), action_id=action_id)
        client = CliSlurmClient(self._runner(run, run.submission), timeout_s=self._timeout_s)
        return client.submit(request)

    def _runner(self, run: Run, record: Mapping[str, Any]) -> OwnerRunner:
        if self._uid not in (ROOT_UID, run.owner_uid):
            raise SubmissionError(
                f"this daemon runs as uid {self._uid} and may submit jobs only as itself; run "
                f"{run.id} belongs to {run.owner_name} (uid {run.owner_uid}): {WAITING_FOR_OWNER}"
            )
        try:
            owner = pwd.getpwuid(run.owner_uid)
        except KeyError:
            raise SubmissionError(
                f"the run's owner uid {run.owner_uid} is unknown on this host; {WAITING_FOR_OWNER}"
            ) from None
        env = {
            "HOME": owner.pw_dir,
            "USER": owner.pw_name,
            "LOGNAME": owner.pw_name,
            "SHELL": owner.pw_shell or "/bin/sh",
            "PATH": str(record.get("path") or DEFAULT_PATH),
        }
        if self._slurm_conf:
            env["SLURM_CONF"] = self._slurm_conf
        elif "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        workdir = str(record.get("workdir") or owner.pw_dir)
        return OwnerRunner(owner, env, workdir, switch_user=self._uid != run.owner_uid)
