"""Reading a failed Slurm command: which SlurmError it is.

The messages are Slurm's own (recorded from 22.05.8 in tests/fixtures/slurm/). The order
matters: "cannot reach slurmctld" is checked first, because a query that could not be sent says
nothing about any job and must never be read as "job not found" or "job failed".
"""

from __future__ import annotations

from slurmft.slurm.api import (
    SlurmBadRequest,
    SlurmError,
    SlurmJobNotFound,
    SlurmPermissionDenied,
    SlurmTimeout,
    SlurmUnreachable,
)
from slurmft.slurm.runner import CommandResult

_UNREACHABLE = (
    "unable to contact slurm controller",
    "connection refused",
    "communication connection failure",
    "zero bytes were transmitted or received",
    "unable to establish control machine",
    "unable to process configuration file",
    "could not establish a configuration source",
    "munge",  # munge_encode/decode failures: the request never authenticated
    "authentication failure",
    "protocol authentication error",
)
_TIMEOUT = ("socket timed out", "timed out on send/recv")
_PERMISSION = (
    "access/permission denied",
    "invalid user id",  # 22.05 answers a non-admin node update with this
    "permission denied",
    "not authorized",
)
_JOB_NOT_FOUND = ("invalid job id specified", "invalid job id:")
_BAD_REQUEST = (
    "invalid",
    # 22.05 without slurmdbd: any update of a job that lost a node (slurmctld waits 5 s for a
    # db_index that never comes; scontrol gives up after MessageTimeout). docs/slurm.md.
    "unexpected message received",
    "already completing or completed",
    "no longer pending",
    "not available",
    "only batch jobs",
    "unrecognized option",
    "batch job submission failed",
    "requested node configuration",
)


def classify_failure(result: CommandResult) -> SlurmError:
    """The typed error for a command that exited non-zero."""
    text = f"{result.stderr}\n{result.stdout}".strip()
    lowered = text.lower()
    first_line = text.splitlines()[0] if text else f"exit status {result.returncode}"
    command = result.argv[0] if result.argv else "slurm"
    for patterns, error_type in (
        (_UNREACHABLE, SlurmUnreachable),
        (_TIMEOUT, SlurmTimeout),
        (_PERMISSION, SlurmPermissionDenied),
        (_JOB_NOT_FOUND, SlurmJobNotFound),
        (_BAD_REQUEST, SlurmBadRequest),
    ):
        if any(pattern in lowered for pattern in patterns):
            return error_type(
                _message(command, error_type, first_line), argv=result.argv, stderr=result.stderr
            )
    return SlurmError(f"{command} failed: {first_line}", argv=result.argv, stderr=result.stderr)


def _message(command: str, error_type: type[SlurmError], detail: str) -> str:
    advice = {
        SlurmUnreachable: "is slurmctld running and SLURM_CONF right? retry later",
        SlurmTimeout: "slurmctld is slow; retry later",
        SlurmPermissionDenied: "this needs root, SlurmUser or an Operator account",
    }.get(error_type)
    return f"{command}: {detail}" + (f" ({advice})" if advice else "")
