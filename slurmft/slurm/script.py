"""Making untrusted strings safe before they reach Slurm.

Run names and program arguments come from users. They reach Slurm in two ways only:
- inside the batch script, where every word is shell-quoted (`shlex.quote`), so `$(...)`, `;`,
  quotes and newlines are inert data;
- as argv entries of sbatch/scontrol (never through a shell), after validation: Slurm itself
  prints job names and comments back inside `|`-separated and `Key=value` output that slurmft
  parses, so those two are restricted to characters that cannot break that output.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from slurmft.slurm.api import JobInfo, SlurmBadRequest

# Validators: fullmatch, in ASCII (`$` matches before a final newline, so `^...$` took a name
# ending in one; `\d` takes every script's digits).
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}", re.ASCII)
_RUN_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}", re.ASCII)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_SIGNAL = re.compile(r"([BR]{1,2}:)?(SIG)?[A-Z0-9]{1,8}(@\d{1,6})?", re.ASCII)
_TIME_LIMIT = re.compile(r"(UNLIMITED|INFINITE|\d+(-\d+)?(:\d+){0,2})", re.ASCII)
_SIGNAL_NAME = re.compile(r"(SIG)?[A-Z0-9]{1,8}", re.ASCII)
_PARTITION = re.compile(r"[A-Za-z0-9_.\-]{1,64}", re.ASCII)
# Site options: what sbatch takes for each, restricted to the characters those values use.
_GRES = re.compile(
    r"[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+){0,2}(,[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+){0,2})*",
    re.ASCII,
)
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.\-&|,\[\]*:()!]{1,256}", re.ASCII)
_MEMORY = re.compile(r"\d{1,12}[KMGT]?", re.ASCII)
_COMMENT_PREFIX = "slurmft-run:"
_ACTION_SEPARATOR = " "
_ACTION_PREFIX = "slurmft-action:"
MAX_REASON_CHARS = 256


def job_name_for(run_name: str) -> str:
    """A Slurm job name derived from any run name: unsafe characters become `_`."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\-]", "_", run_name).strip("_.-")[:100]
    return f"slurmft-{cleaned or 'run'}"


def check_job_name(name: str) -> str:
    if not _SAFE_NAME.fullmatch(name):
        raise SlurmBadRequest(f"job name {name!r} must match [A-Za-z0-9_.-]{{1,128}}")
    return name


def comment_for_run(run_id: str, action_id: int | None = None) -> str:
    """The --comment that tags a job with its run: `slurmft-run:<run id>`; a job the daemon
    submits carries the id of the action that submitted it too (`slurmft-action:<id>`), so a
    daemon that stopped before it recorded sbatch's answer finds the job instead of submitting
    another (slurmft.controller.intents)."""
    if not _RUN_ID.fullmatch(run_id):
        raise SlurmBadRequest(f"run id {run_id!r} must match [A-Za-z0-9_.-]{{1,64}}")
    if action_id is None:
        return _COMMENT_PREFIX + run_id
    return f"{_COMMENT_PREFIX}{run_id}{_ACTION_SEPARATOR}{_ACTION_PREFIX}{int(action_id)}"


def run_id_from_comment(comment: str) -> str | None:
    head = comment.split(_ACTION_SEPARATOR, 1)[0]
    if not head.startswith(_COMMENT_PREFIX):
        return None
    run_id = head.removeprefix(_COMMENT_PREFIX)
    return run_id if _RUN_ID.fullmatch(run_id) else None


def action_id_from_comment(comment: str) -> int | None:
    """The id of the daemon's action that submitted the job, when it did."""
    _, _, tail = comment.partition(_ACTION_SEPARATOR)
    if run_id_from_comment(comment) is None or not tail.startswith(_ACTION_PREFIX):
        return None
    digits = tail.removeprefix(_ACTION_PREFIX)
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 18 else None


def not_the_runs_job(job: JobInfo, run_id: str, owner_uid: int) -> str | None:
    """Why Slurm's record of ``job`` says it is not the run's, or None when it is: submitted by
    the run's owner and tagged with the run's comment. The daemon acts on a job (cancel, requeue,
    attach) only after this, with its own rights, so no user's claim can point it at another
    user's job."""
    if job.user_id is None:
        return f"Slurm did not say who owns job {job.job_id}"
    if job.user_id != owner_uid:
        return f"job {job.job_id} belongs to uid {job.user_id}, the run to uid {owner_uid}"
    tagged = run_id_from_comment(job.comment)
    if tagged != run_id:
        found = f"run {tagged}" if tagged else f"no run (comment {job.comment!r})"
        return f"job {job.job_id} is tagged with {found}, not run {run_id}"
    return None


def check_reason(reason: str) -> str:
    """Drain/down reasons go to scontrol as one argv word; Slurm keeps them verbatim (measured),
    but a newline would split `sinfo`/`scontrol -o` lines, so control characters are refused."""
    reason = reason.strip()
    if not reason:
        raise SlurmBadRequest("a reason is required")
    if any(ord(char) < 32 or ord(char) == 127 for char in reason):
        raise SlurmBadRequest(f"reason contains control characters: {reason!r}")
    if len(reason) > MAX_REASON_CHARS:
        raise SlurmBadRequest(f"reason longer than {MAX_REASON_CHARS} characters")
    return reason


TRUNCATED_MARK = " [truncated]"


def slurm_reason(reason: str) -> str:
    """A drain/down reason Slurm takes: control characters become spaces and a reason longer
    than MAX_REASON_CHARS is cut, ending in TRUNCATED_MARK (the action row keeps it whole)."""
    cleaned = " ".join(
        "".join(" " if ord(char) < 32 or ord(char) == 127 else char for char in reason).split()
    )
    if len(cleaned) <= MAX_REASON_CHARS:
        return cleaned
    return cleaned[: MAX_REASON_CHARS - len(TRUNCATED_MARK)].rstrip() + TRUNCATED_MARK


def check_signal_spec(spec: str) -> str:
    """`--signal` values: `[B:|R:]SIG[@seconds]`, e.g. `B:USR1@300`."""
    if not _SIGNAL.fullmatch(spec):
        raise SlurmBadRequest(f"bad --signal value {spec!r} (expected e.g. B:USR1@300)")
    return spec


def check_signal_name(name: str) -> str:
    if not _SIGNAL_NAME.fullmatch(name):
        raise SlurmBadRequest(f"bad signal name {name!r} (expected e.g. USR1 or TERM)")
    return name


def check_time_limit(limit: str) -> str:
    if not _TIME_LIMIT.fullmatch(limit):
        raise SlurmBadRequest(f"bad time limit {limit!r} (expected e.g. 60, 1:00:00, 2-00:00:00)")
    return limit


def check_partition(partition: str) -> str:
    return check_slurm_name("partition", partition)


def check_slurm_name(kind: str, value: str) -> str:
    """A partition, account, QOS or reservation name."""
    if not _PARTITION.fullmatch(value):
        raise SlurmBadRequest(f"bad {kind} name {value!r}")
    return value


def check_gres(gres: str) -> str:
    """`gpu:2`, `gpu:a100:8`, `gpu:2,nvme:1`."""
    if len(gres) > 256 or not _GRES.fullmatch(gres):
        raise SlurmBadRequest(f"bad GRES {gres!r} (expected e.g. gpu:2 or gpu:a100:8)")
    return gres


def check_constraint(constraint: str) -> str:
    """A node-feature expression: `a100`, `a100&ib`, `[rack1|rack2]`."""
    if not _CONSTRAINT.fullmatch(constraint):
        raise SlurmBadRequest(f"bad constraint {constraint!r} (features joined by & | , [])")
    return constraint


def check_memory(memory: str) -> str:
    """Memory per node: a number, optionally K, M, G or T (MB by default, as sbatch --mem)."""
    if not _MEMORY.fullmatch(memory):
        raise SlurmBadRequest(f"bad memory {memory!r} (expected e.g. 500G or 0 for all)")
    return memory


def is_env_name(name: str) -> bool:
    """A name the batch script can `export`: letters, digits and `_`, not starting with a digit."""
    return _ENV_NAME.fullmatch(name) is not None


def check_path(path: str) -> str:
    if not path or any(ord(char) < 32 for char in path):
        raise SlurmBadRequest(f"bad path {path!r}")
    return path


def render_batch_script(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    setup: Sequence[str] = (),
) -> str:
    """A bash batch script that runs `command` with `env` set, after the user's own `setup`
    lines (shell code, run as written: `module load`, `conda activate`). Every word of `env` and
    `command` is quoted: the script runs exactly these argv lists whatever characters they
    contain. The setup lines run before `set -u`: activation scripts read unset variables."""
    if not command:
        raise SlurmBadRequest("empty command")
    lines = ["#!/bin/bash", "# Generated by slurmft. Every word below is shell-quoted."]
    for name, value in (env or {}).items():
        if not is_env_name(name):
            raise SlurmBadRequest(f"bad environment variable name {name!r}")
        lines.append(f"export {name}={shlex.quote(value)}")
    if setup:
        lines.append("# Setup lines (slurmft submit --setup), run as given:")
        lines.extend(setup)
    lines.append("set -u")
    lines.append(f"exec {shlex.join(command)}")
    return "\n".join(lines) + "\n"
