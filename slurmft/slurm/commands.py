"""Pure argv builders: what slurmft asks each Slurm command. No I/O here.

Formats are the stable pipe-separated ones (`squeue -o`, `sinfo -N -o`) and `scontrol -o`, read by
parse.py. The free-text field of each format goes last, so a `|` inside it cannot shift the
fields before it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from slurmft.slurm import passthrough, script
from slurmft.slurm.api import SignalTarget, SlurmBadRequest, SubmitRequest
from slurmft.slurm.hostlist import compress
from slurmft.slurm.names import check_node_name

# squeue: job id, state (long), reason, nodes, batch host, comment, name (free text: last).
SQUEUE_FIELDS = ("job_id", "state", "reason", "nodes", "batch_host", "comment", "name")
SQUEUE_FORMAT = "%i|%T|%r|%N|%B|%k|%j"
# sinfo -N: node, state (long, with suffix characters), reason user, reason time, reason (last).
SINFO_FIELDS = ("name", "state", "reason_user", "reason_time", "reason")
SINFO_FORMAT = "%N|%T|%u|%H|%E"
# squeue --steps: step id (job.step), the step's nodes.
STEPS_FORMAT = "%i|%N"

_JOB_ID = re.compile(r"\d+([_+]\d+)?", re.ASCII)  # fullmatch: no final newline


def is_job_id(job_id: object) -> bool:
    """A Slurm job id: `123`, an array task `123_4` or a het component `123+1`."""
    return isinstance(job_id, str) and _JOB_ID.fullmatch(job_id) is not None


def check_job_id(job_id: str) -> str:
    if not is_job_id(job_id):
        raise SlurmBadRequest(f"not a Slurm job id: {job_id!r}")
    return job_id


def version_argv() -> list[str]:
    return ["sinfo", "--version"]


def submit_argv(request: SubmitRequest) -> list[str]:
    """sbatch reads the script from stdin; every option is one argv word (no shell)."""
    if request.nodes < 1 or request.spare_nodes < 0:
        raise SlurmBadRequest(
            f"need nodes >= 1 and spares >= 0, got {request.nodes}+{request.spare_nodes}"
        )
    # A site's options first: sbatch takes the last of an option given twice, so nothing in them
    # could override slurmft's own below (the refusal table keeps those out anyway).
    site = passthrough.check("sbatch", request.sbatch_args)
    argv = [
        "sbatch",
        *site,
        "--parsable",
        f"--job-name={script.check_job_name(request.job_name)}",
        f"--comment={script.comment_for_run(request.run_id, request.action_id)}",
        f"--nodes={request.total_nodes}",
        "--requeue" if request.requeue else "--no-requeue",
    ]
    if request.no_kill:
        argv.append("--no-kill")
    if request.exclude:
        nodes = [check_node_name(node) for node in request.exclude]
        argv.append(f"--exclude={compress(nodes)}")
    if request.signal:
        argv.append(f"--signal={script.check_signal_spec(request.signal)}")
    if request.time_limit:
        argv.append(f"--time={script.check_time_limit(request.time_limit)}")
    if request.partition:
        argv.append(f"--partition={script.check_partition(request.partition)}")
    if request.ntasks_per_node:
        argv.append(f"--ntasks-per-node={int(request.ntasks_per_node)}")
    if request.cpus_per_task:
        argv.append(f"--cpus-per-task={int(request.cpus_per_task)}")
    argv += _site_options(request)
    if request.output:
        argv.append(f"--output={script.check_path(request.output)}")
        if not any(option.startswith("--open-mode=") for option in site):
            # A requeued job starts again under its job id, so in the same file, which Slurm
            # truncates by default (JobFileAppend=0): the failed attempt's lines, the ones that
            # say why it failed, would be gone. A site's own --open-mode stands.
            argv.append("--open-mode=append")
    if request.workdir:
        argv.append(f"--chdir={script.check_path(request.workdir)}")
    return argv


def _site_options(request: SubmitRequest) -> list[str]:
    argv = []
    if request.gpus_per_node:
        argv.append(f"--gpus-per-node={int(request.gpus_per_node)}")
    if request.gres:
        argv.append(f"--gres={script.check_gres(request.gres)}")
    for flag, kind, value in (
        ("--account", "account", request.account),
        ("--qos", "QOS", request.qos),
        ("--reservation", "reservation", request.reservation),
    ):
        if value:
            argv.append(f"{flag}={script.check_slurm_name(kind, value)}")
    if request.constraint:
        argv.append(f"--constraint={script.check_constraint(request.constraint)}")
    if request.mem:
        argv.append(f"--mem={script.check_memory(request.mem)}")
    if request.exclusive:
        argv.append("--exclusive")
    return argv


def squeue_argv(job_ids: Sequence[str]) -> list[str]:
    """All the jobs in one call: polling per job multiplies the load on slurmctld."""
    ids = ",".join(check_job_id(job_id) for job_id in job_ids)
    return ["squeue", "--noheader", "--states=all", f"--jobs={ids}", f"--format={SQUEUE_FORMAT}"]


def squeue_user_argv(uid: int) -> list[str]:
    """Every job of one user that slurmctld still knows, in the same format as `squeue_argv`."""
    if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < 2**32:
        raise SlurmBadRequest(f"not a user id: {uid!r}")
    return ["squeue", "--noheader", "--states=all", f"--user={uid}", f"--format={SQUEUE_FORMAT}"]


def squeue_steps_argv(job_id: str) -> list[str]:
    """The job's live steps and the nodes each was launched on: a `--no-kill` job that lost a
    node no longer names it, but its steps still do (measured on 22.05)."""
    return ["squeue", "--noheader", "--steps", f"--jobs={check_job_id(job_id)}",
            f"--format={STEPS_FORMAT}"]  # fmt: skip


def show_job_argv(job_id: str) -> list[str]:
    return ["scontrol", "--oneliner", "show", "job", check_job_id(job_id)]


def sinfo_nodes_argv(names: Sequence[str] = ()) -> list[str]:
    argv = ["sinfo", "--noheader", "--Node", f"--format={SINFO_FORMAT}"]
    if names:
        argv.append(f"--nodes={compress(check_node_name(name) for name in names)}")
    return argv


def show_node_argv(name: str) -> list[str]:
    return ["scontrol", "--oneliner", "show", "node", check_node_name(name)]


def show_nodes_argv() -> list[str]:
    """Every node of the cluster, one record per line (NodeAddr is not in sinfo's format)."""
    return ["scontrol", "--oneliner", "show", "node"]


def drain_argv(node: str, reason: str) -> list[str]:
    return _update_node(node, "DRAIN", reason)


def down_argv(node: str, reason: str) -> list[str]:
    return _update_node(node, "DOWN", reason)


def resume_argv(node: str) -> list[str]:
    return ["scontrol", "update", f"NodeName={check_node_name(node)}", "State=RESUME"]


def _update_node(node: str, state: str, reason: str) -> list[str]:
    return [
        "scontrol",
        "update",
        f"NodeName={check_node_name(node)}",
        f"State={state}",
        f"Reason={script.check_reason(reason)}",
    ]


def requeue_argv(job_id: str, *, hold: bool = False) -> list[str]:
    return ["scontrol", "requeuehold" if hold else "requeue", check_job_id(job_id)]


def release_argv(job_id: str) -> list[str]:
    return ["scontrol", "release", check_job_id(job_id)]


def set_excluded_nodes_argv(job_id: str, nodes: Sequence[str]) -> list[str]:
    """An empty list clears the excluded nodes."""
    hostlist = compress(check_node_name(node) for node in nodes) if nodes else ""
    return ["scontrol", "update", f"JobId={check_job_id(job_id)}", f"ExcNodeList={hostlist}"]


def cancel_argv(job_id: str) -> list[str]:
    return ["scancel", check_job_id(job_id)]


def signal_argv(job_id: str, signal: str, target: SignalTarget) -> list[str]:
    # Measured on 22.05: --signal alone reaches the steps only; --batch the batch shell only.
    where = {SignalTarget.STEPS: [], SignalTarget.BATCH: ["--batch"], SignalTarget.ALL: ["--full"]}
    return [
        "scancel",
        f"--signal={script.check_signal_name(signal)}",
        *where[target],
        check_job_id(job_id),
    ]
