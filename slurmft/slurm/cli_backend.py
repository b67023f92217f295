"""The SlurmClient that drives Slurm through its command-line tools.

Every call is build argv (commands.py, pure) -> run (the one Runner seam) -> parse (parse.py,
pure). A failed command becomes a typed SlurmError (failures.py); in particular a slurmctld that
does not answer raises SlurmUnreachable and is never reported as a missing or failed job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from slurmft.slurm import commands, parse
from slurmft.slurm.api import (
    JobInfo,
    NodeInfo,
    SignalTarget,
    SlurmBadRequest,
    SlurmError,
    SlurmJobNotFound,
    SlurmPermissionDenied,
    SlurmTimeout,
    SlurmUnreachable,
    SubmitRequest,
)
from slurmft.slurm.failures import classify_failure
from slurmft.slurm.runner import DEFAULT_TIMEOUT_S, CommandResult, Runner, SubprocessRunner
from slurmft.slurm.version import SlurmVersion, parse_version

log = logging.getLogger(__name__)


class CliSlurmClient:
    """SlurmClient over sbatch/squeue/sinfo/scontrol/scancel."""

    def __init__(
        self,
        runner: Runner | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        slurm_conf: str | None = None,
    ) -> None:
        env = {"SLURM_CONF": slurm_conf} if slurm_conf else None
        self._runner = runner or SubprocessRunner(env)
        self._timeout_s = timeout_s
        self._version: SlurmVersion | None = None

    def _run(self, argv: list[str], *, stdin: str | None = None) -> CommandResult:
        result = self._runner.run(argv, self._timeout_s, stdin=stdin)
        if not result.ok:
            raise classify_failure(result)
        return result

    # --- queries ---------------------------------------------------------------------------------

    def version(self) -> SlurmVersion:
        if self._version is None:
            self._version = parse_version(self._run(commands.version_argv()).stdout)
        return self._version

    def jobs(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """The jobs Slurm knows among ``job_ids``, in one squeue call. Slurm 22.05 prints a
        job's name and comment as they are, newlines included, so a user's text can hold what
        reads as a row of another job. Then (the output has a job twice, or a line no row could
        be) each job is read alone from its scontrol record, and a row is only ever taken for
        a job that was asked about: one user's text never stops or steers the read of others."""
        if not job_ids:
            return {}
        try:
            result = self._run(commands.squeue_argv(job_ids))
        except SlurmJobNotFound:
            # squeue -j with a single unknown id exits 1; with several it prints what it knows.
            return {}
        try:
            found = parse.parse_squeue(result.stdout)
        except SlurmError as error:
            log.warning("squeue's rows cannot be told apart (%s): each job read alone", error)
            return self._each_alone(job_ids)
        asked = set(job_ids)
        return {job_id: job for job_id, job in found.items() if job_id in asked}

    def _each_alone(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """Each job from its own scontrol record; one Slurm cannot give (gone, or a record
        that cannot be read) is left out, for the caller to ask about again and record."""
        jobs: dict[str, JobInfo] = {}
        for job_id in job_ids:
            try:
                jobs[job_id] = self.job(job_id)
            except (SlurmUnreachable, SlurmTimeout):
                raise
            except SlurmError:
                continue
        return jobs

    def jobs_of_user(self, uid: int) -> dict[str, JobInfo]:
        return parse.parse_squeue(self._run(commands.squeue_user_argv(uid)).stdout)

    def job(self, job_id: str) -> JobInfo:
        records = parse.parse_scontrol_records(self._run(commands.show_job_argv(job_id)).stdout)
        if not records:
            raise SlurmJobNotFound(f"scontrol printed nothing for job {job_id}")
        return parse.job_from_scontrol(records[0])

    def step_nodes(self, job_id: str) -> frozenset[str]:
        try:
            result = self._run(commands.squeue_steps_argv(job_id))
        except SlurmJobNotFound:
            return frozenset()  # ended and purged: it has no steps
        steps = parse.parse_squeue_steps(result.stdout)
        return frozenset(node for nodes in steps.values() for node in nodes)

    def nodes(self, names: Sequence[str] = ()) -> dict[str, NodeInfo]:
        return parse.parse_sinfo_nodes(self._run(commands.sinfo_nodes_argv(names)).stdout)

    def node(self, name: str) -> NodeInfo:
        records = parse.parse_scontrol_records(self._run(commands.show_node_argv(name)).stdout)
        if not records:
            raise SlurmBadRequest(f"scontrol printed nothing for node {name}")
        return parse.node_from_scontrol(records[0])

    def node_addresses(self) -> dict[str, str]:
        records = parse.parse_scontrol_records(self._run(commands.show_nodes_argv()).stdout)
        return {r["NodeName"]: r.get("NodeAddr") or r["NodeName"] for r in records}

    def batch_host_down(self, job_id: str) -> bool:
        job = self.job(job_id)
        if not job.holds_nodes_now or not job.batch_host:
            return False
        return self.node(job.batch_host).status.lost

    # --- actions ---------------------------------------------------------------------------------

    def submit(self, request: SubmitRequest) -> str:
        result = self._run(commands.submit_argv(request), stdin=request.script)
        return parse.parse_sbatch_parsable(result.stdout)

    def drain(self, node: str, reason: str) -> None:
        self._run(commands.drain_argv(node, reason))

    def resume(self, node: str) -> None:
        self._run(commands.resume_argv(node))

    def down(self, node: str, reason: str) -> None:
        self._run(commands.down_argv(node, reason))

    def requeue(self, job_id: str, exclude: Sequence[str] | None = None) -> None:
        """A plain requeue, then the excluded nodes set while the job completes (it cannot
        start before). Never `requeuehold`: 22.05 without slurmdbd refuses every update of a
        job that lost a node ("Unexpected message received"), for good when its requeue ends
        through a node failure, so a held job's release can fail for ever (docs/slurm.md).
        A refused exclusion is logged, not raised: the requeue happened, and the daemon sets
        the list again while the job waits (decide's `_keep_excluded`)."""
        self._requeue_checked(job_id)
        if exclude is None:
            return
        try:
            self._run(commands.set_excluded_nodes_argv(job_id, exclude))
        except SlurmError as error:
            log.warning(
                "job %s was requeued, but Slurm refused its excluded nodes (%s): they are set "
                "again while it waits", job_id, error
            )  # fmt: skip

    def _requeue_checked(self, job_id: str) -> None:
        """Requeue, and trust Slurm's job record over scontrol's answer: on a loaded slurmctld
        scontrol can fail ("Unexpected message received", a timed-out RPC) after the requeue was
        carried out. A failure counted as such would be retried later and requeue the job's next
        run. So a failed requeue is checked against the job's restart count from before."""
        before = self._restarts(job_id)
        try:
            self._run(commands.requeue_argv(job_id))
        except (SlurmJobNotFound, SlurmPermissionDenied):
            raise  # refused: nothing happened
        except SlurmError as error:
            after = self._restarts(job_id)
            if before is None or after is None or after <= before:
                raise
            log.warning(
                "scontrol reported %s for the requeue of job %s, but Slurm carried it out "
                "(Restarts %d -> %d)", error, job_id, before, after
            )  # fmt: skip

    def _restarts(self, job_id: str) -> int | None:
        """The job's requeue count; None when Slurm cannot say."""
        try:
            return self.job(job_id).restarts
        except SlurmError:
            return None

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._run(commands.set_excluded_nodes_argv(job_id, nodes))

    def cancel(self, job_id: str) -> None:
        self._run(commands.cancel_argv(job_id))

    def signal(self, job_id: str, signal: str, target: SignalTarget) -> None:
        self._run(commands.signal_argv(job_id, signal, target))
