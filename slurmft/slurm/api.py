"""The contract between slurmft and Slurm: the SlurmClient protocol, what it returns, its errors.

The CLI backend (cli_backend.py) is the implementation that is tested against a real cluster; a
pyslurm backend would be one more module implementing the same protocol.

Errors say what happened to the *request*, never what happened to a job: when slurmctld cannot be
reached, every call raises SlurmUnreachable, and no caller may read that as "the job failed" or
"the job is gone".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

from slurmft.errors import SlurmftError
from slurmft.slurm.states import JobState, NodeStatus
from slurmft.slurm.version import SlurmVersion

# --- errors -------------------------------------------------------------------------------------


class SlurmError(SlurmftError):
    """A Slurm command failed. `argv` and `stderr` say which and how."""

    def __init__(self, message: str, *, argv: Sequence[str] = (), stderr: str = "") -> None:
        super().__init__(message)
        self.argv = list(argv)
        self.stderr = stderr


class SlurmUnreachable(SlurmError):
    """slurmctld did not answer (down, wrong SLURM_CONF, munge broken, commands not installed).

    Says nothing about any job: retry later, never conclude a job ended."""


class SlurmTimeout(SlurmError):
    """The command did not finish in time (slurmctld overloaded or hung). Retry later."""


class SlurmPermissionDenied(SlurmError):
    """Slurm refused: draining or downing a node needs root, SlurmUser or an Operator account."""


class SlurmBadRequest(SlurmError):
    """Slurm rejected the request itself (unknown job or node, a job in the wrong state, a bad
    option); sending it again will not help."""


class SlurmJobNotFound(SlurmBadRequest):
    """slurmctld does not know the job id (never existed, or purged after MinJobAge)."""


# --- what Slurm reports -------------------------------------------------------------------------


@dataclass(frozen=True)
class JobInfo:
    """One job as `squeue` or `scontrol show job` reports it.

    `nodes` are the nodes the job holds *now* (a `--no-kill` job shrinks when one dies);
    `batch_host` is the node running the batch script (empty while pending)."""

    job_id: str
    state: JobState
    reason: str = ""
    nodes: tuple[str, ...] = ()
    batch_host: str = ""
    name: str = ""
    comment: str = ""
    restarts: int = 0
    excluded_nodes: tuple[str, ...] = ()
    exit_code: str = ""
    requeue: bool | None = None
    # The owner's uid (scontrol's `UserId=name(uid)`, the JSON's `user_id`); None where the
    # source does not say (squeue's pipe format).
    user_id: int | None = None
    raw: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def holds_nodes_now(self) -> bool:
        return self.state.holds_nodes


@dataclass(frozen=True)
class NodeInfo:
    """One node as `sinfo -N` or `scontrol show node` reports it."""

    name: str
    status: NodeStatus
    reason: str = ""
    reason_user: str = ""
    reason_time: str = ""
    raw: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)


def silent_nodes(names: Iterable[str], info: Mapping[str, NodeInfo]) -> list[str]:
    """Those of ``names`` (a job's nodes) whose slurmd is silent and that Slurm has not marked
    DOWN yet, in order: a --no-kill job still holds them. A node ``info`` lacks is not one."""
    return [name for name in names if name in info and info[name].status.silent_not_down]


class SignalTarget(Enum):
    """Who receives a signal. Measured on 22.05: `scancel --signal` alone reaches only the steps,
    `--batch` only the batch shell, `--full` both."""

    STEPS = "steps"
    BATCH = "batch"
    ALL = "all"


@dataclass(frozen=True)
class SubmitRequest:
    """A batch job. `script` is the whole batch script text (see script.py to build one safely);
    untrusted strings never go into the argv here except through validated fields."""

    script: str
    job_name: str
    run_id: str
    nodes: int
    spare_nodes: int = 0
    no_kill: bool = True
    requeue: bool = True
    exclude: tuple[str, ...] = ()
    signal: str | None = None  # e.g. "B:USR1@300": USR1 to the batch shell 300 s before the end
    time_limit: str | None = None
    partition: str | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    # Site options (slurmft submit --gpus-per-node, --account, ...): the job's, and resubmitted.
    gpus_per_node: int | None = None
    gres: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mem: str | None = None
    exclusive: bool = False
    reservation: str | None = None
    # A site's own sbatch options (slurmft.slurm.passthrough), checked again at every submit.
    sbatch_args: tuple[str, ...] = ()
    output: str | None = None
    workdir: str | None = None
    # The daemon's action that submits this job (a resubmission): tagged in its comment.
    action_id: int | None = None

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spare_nodes


# --- the protocol -------------------------------------------------------------------------------


@runtime_checkable
class SlurmClient(Protocol):
    """What slurmft needs from Slurm. Every method may raise the SlurmError subclasses above."""

    def version(self) -> SlurmVersion: ...

    def submit(self, request: SubmitRequest) -> str:
        """Submit a batch job; returns its job id."""
        ...

    def jobs(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """Many jobs in one call. A job id missing from the result is unknown to slurmctld now
        (ended and purged, or never existed) — not an error, and not a failure by itself."""
        ...

    def jobs_of_user(self, uid: int) -> dict[str, JobInfo]:
        """Every job of one user that slurmctld knows now, in one call (as ``jobs``)."""
        ...

    def job(self, job_id: str) -> JobInfo:
        """One job in detail (Restarts, ExcNodeList, BatchHost). Raises SlurmJobNotFound."""
        ...

    def step_nodes(self, job_id: str) -> frozenset[str]:
        """The nodes the job's live steps were launched on. Under --no-kill a job that lost a
        node no longer names it, but a step that runs on still does: Slurm's word that the job
        had the node (empty for a job without steps, or one slurmctld no longer knows)."""
        ...

    def nodes(self, names: Sequence[str] = ()) -> dict[str, NodeInfo]:
        """Nodes by name (all nodes when `names` is empty), in one call."""
        ...

    def node(self, name: str) -> NodeInfo: ...

    def node_addresses(self) -> dict[str, str]:
        """Every node's NodeAddr (what slurmctld and the nodes' peers connect to)."""
        ...

    def drain(self, node: str, reason: str) -> None: ...

    def resume(self, node: str) -> None: ...

    def down(self, node: str, reason: str) -> None: ...

    def requeue(self, job_id: str, exclude: Sequence[str] | None = None) -> None:
        """Requeue a job (same job id, same owner). With `exclude`, the job's excluded nodes
        are then replaced by that list while it completes, if Slurm accepts the update (a
        refusal is logged: the requeue stands, and the caller sets the list again later)."""
        ...

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        """Replace a *pending* job's excluded nodes (ExcNodeList)."""
        ...

    def cancel(self, job_id: str) -> None: ...

    def signal(self, job_id: str, signal: str, target: SignalTarget) -> None: ...

    def batch_host_down(self, job_id: str) -> bool:
        """True when the job is running but the node holding its batch script is lost: under
        --no-kill Slurm leaves such a job RUNNING forever, so the caller must requeue it."""
        ...
