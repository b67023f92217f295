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

The recorded working directory and PATH are the user's to choose, so neither is used with the
daemon's rights: the child enters the directory only after it has become the owner (a root
daemon that changed into it first let the job start in a folder the owner cannot reach), and
the sbatch it runs is the one on the daemon's own PATH, by absolute path, never one the
recorded PATH finds (the recorded PATH is only passed on to the job).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, replace
from typing import TYPE_CHECKING, Any

from slurmft.slurm import CliSlurmClient, passthrough
from slurmft.slurm.api import SlurmBadRequest, SlurmError, SubmitRequest
from slurmft.slurm.runner import CommandResult

if TYPE_CHECKING:
    from slurmft.db.models import Run

ROOT_UID = 0
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
WAITING_FOR_OWNER = "waiting for the owner"
# The child could not enter the recorded working directory as the owner (it then exits with
# this status and says why on stderr after this marker, instead of running sbatch).
ENTER_FAILED_EXIT = 126
_ENTER_FAILED = "slurmft: cannot enter the working directory: "


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
    "gpus_per_node": (int, True),
    "gres": (str, True),
    "account": (str, True),
    "qos": (str, True),
    "constraint": (str, True),
    "mem": (str, True),
    "exclusive": (bool, False),
    "reservation": (str, True),
    "sbatch_args": ((list, tuple), False),
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
    try:
        sbatch_args = passthrough.check("sbatch", request.sbatch_args)
    except SlurmBadRequest as error:
        raise SubmissionError(f"the recorded submission's sbatch_args: {error}") from None
    if not isinstance(request.script, str) or not request.script.startswith("#!"):
        raise SubmissionError("the recorded submission has no batch script")
    return replace(request, exclude=tuple(sorted(exclude)), sbatch_args=sbatch_args)


def check_record(record: object) -> dict[str, Any]:
    """A submission record as sent by a client, checked before it is stored."""
    if not isinstance(record, dict):
        raise SubmissionError("a submission record is a JSON object")
    request_from_record(record, ())
    return record


def submit_environment(
    owner: pwd.struct_passwd, path: str, slurm_conf: str | None = None
) -> dict[str, str]:
    """The environment sbatch runs in, and so the job's (sbatch exports its own): the owner's
    identity, the PATH recorded at submit, SLURM_CONF. The same for `slurmft submit` and for
    every resubmission, so a job never depends on what happened to be set in one shell; what a
    run needs is in its batch script (`--env`, setup lines)."""
    env = {
        "HOME": owner.pw_dir,
        "USER": owner.pw_name,
        "LOGNAME": owner.pw_name,
        "SHELL": owner.pw_shell or "/bin/sh",
        "PATH": path,
    }
    slurm_conf = slurm_conf or os.environ.get("SLURM_CONF")
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    return env


def trusted_search_path(path: str | None = None) -> str:
    """The daemon's own PATH (default: its environment's), absolute entries only: where the
    Slurm commands it runs for an owner are looked up, never in the owner's recorded PATH."""
    entries = (path if path is not None else os.environ.get("PATH", DEFAULT_PATH)).split(":")
    return ":".join(entry for entry in entries if os.path.isabs(entry)) or DEFAULT_PATH


class OwnerRunner:
    """Runs the Slurm commands for the run's owner: in a clean environment and the submit-time
    working directory, and under the owner's uid, gid and groups when ``switch_user`` (the
    daemon is root). The command is found on ``search_path`` (the daemon's), not on the PATH in
    ``env``, and the directory is entered only once the child is the owner."""

    def __init__(
        self,
        owner: pwd.struct_passwd,
        env: Mapping[str, str],
        workdir: str,
        *,
        switch_user: bool,
        search_path: str | None = None,
    ) -> None:
        self._owner = owner
        self._env = dict(env)
        self._workdir = workdir
        self._switch_user = switch_user
        self._search_path = trusted_search_path(search_path)

    def _program(self, name: str) -> str:
        found = name if os.path.isabs(name) else shutil.which(name, path=self._search_path)
        if found is None:
            raise SubmissionError(
                f"{name} is not on the daemon's PATH ({self._search_path}); {WAITING_FOR_OWNER}",
                argv=(name,),
            )
        return os.path.abspath(found)

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        owner = self._owner
        workdir = self._workdir
        if not os.path.isabs(workdir):
            raise SubmissionError(
                f"the recorded working directory {workdir!r} is not an absolute path; "
                f"{WAITING_FOR_OWNER}",
                argv=argv,
            )
        program = self._program(argv[0])
        identity: dict[str, Any] = {}
        if self._switch_user:
            identity = {
                "user": owner.pw_uid,
                "group": owner.pw_gid,
                "extra_groups": os.getgrouplist(owner.pw_name, owner.pw_gid),
            }

        def enter_workdir() -> None:
            # In the child, after subprocess has switched groups, gid and uid (it runs
            # preexec_fn last): the owner's rights decide whether the directory can be entered.
            # Only system calls here (no import, no lock): the daemon has other threads.
            try:
                os.chdir(workdir)
            except OSError as error:
                os.write(2, f"{_ENTER_FAILED}{error.strerror}\n".encode())
                os._exit(ENTER_FAILED_EXIT)

        try:
            completed = subprocess.run(
                [program, *argv[1:]],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env=self._env,
                preexec_fn=enter_workdir,
                **identity,
            )
        except subprocess.TimeoutExpired as error:
            raise SubmissionError(
                f"{argv[0]} as {owner.pw_name} did not answer within {timeout:g} s", argv=argv
            ) from error
        except OSError as error:  # not permitted, not executable
            raise SubmissionError(
                f"could not run {program} as {owner.pw_name} in {workdir}: {error}", argv=argv
            ) from error
        if completed.returncode == ENTER_FAILED_EXIT and completed.stderr.startswith(_ENTER_FAILED):
            why = completed.stderr.removeprefix(_ENTER_FAILED).strip()
            raise SubmissionError(
                f"could not run {argv[0]} as {owner.pw_name} in {workdir}: {owner.pw_name} "
                f"cannot enter it ({why}); {WAITING_FOR_OWNER}",
                argv=argv,
            )
        return CommandResult(tuple(argv), completed.returncode, completed.stdout, completed.stderr)


class OwnerSubmitter:
    """The executor's ``submit_attempt``: the run's recorded job again, as the run's owner."""

    def __init__(
        self,
        *,
        slurm_conf: str | None,
        timeout_s: float,
        daemon_uid: int | None = None,
        search_path: str | None = None,
    ) -> None:
        self._slurm_conf = slurm_conf
        self._timeout_s = timeout_s
        self._uid = os.geteuid() if daemon_uid is None else daemon_uid
        # Where sbatch is found: the daemon's PATH as it started, never the owner's.
        self._search_path = trusted_search_path(search_path)

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
        env = submit_environment(
            owner, str(record.get("path") or DEFAULT_PATH), self._slurm_conf
        )
        workdir = str(record.get("workdir") or owner.pw_dir)
        return OwnerRunner(
            owner,
            env,
            workdir,
            switch_user=self._uid != run.owner_uid,
            search_path=self._search_path,
        )
