"""Helpers for the contract tests on the real local Slurm cluster.

Each test gets a Cluster that remembers what it did — jobs submitted, nodes drained or killed —
and undoes all of it afterwards, pass or fail, so one test never inherits another's wreckage.
Waits poll with a deadline (support.waiting); there are no fixed sleeps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from slurm_clusters import CLUSTER_SCRIPT
from support.waiting import wait_for_value

from slurmft.slurm.api import JobInfo, SlurmBadRequest, SlurmError, SubmitRequest
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.script import render_batch_script


class Cluster:
    """The client plus the cluster script, with an undo log."""

    def __init__(self, client: CliSlurmClient, slurm_conf: Path, tmp_path: Path) -> None:
        self.client = client
        self.tmp_path = tmp_path
        # The cluster script finds the cluster by its root: <root>/etc/slurm.conf.
        self._root = slurm_conf.parents[1]
        self._script_env = {**os.environ, "SLURMFT_CLUSTER_ROOT": str(self._root)}
        self._jobs: list[str] = []
        self._killed: set[str] = set()
        self._drained: set[str] = set()
        self._frozen: set[str] = set()

    def submit(self, command: Sequence[str], *, nodes: int, **fields: object) -> str:
        fields.setdefault("output", str(self.tmp_path / "job-%j.out"))
        request = SubmitRequest(
            script=render_batch_script(command, env=fields.pop("env", None)),  # type: ignore[arg-type]
            job_name=str(fields.pop("job_name", "slurmft-test")),
            run_id=str(fields.pop("run_id", "test-run")),
            nodes=nodes,
            **fields,  # type: ignore[arg-type]
        )
        job_id = self.client.submit(request)
        self._jobs.append(job_id)
        return job_id

    def preempt(self, node: str, seconds: int = 30) -> str:
        """An `urgent` job (the higher partition tier) that needs all of `node`: Slurm cancels
        the jobs in its way (PreemptMode=CANCEL; they end PREEMPTED)."""
        cpus = int(self.client.node(node).raw["CPUTot"])
        return self.submit(
            ["sleep", str(seconds)],
            nodes=1,
            partition="urgent",
            ntasks_per_node=1,
            cpus_per_task=cpus,
            job_name="slurmft-test-urgent",
            exclude=tuple(n for n in self.client.nodes() if n != node),
        )

    def wait_running(self, job_id: str, timeout_s: float = 30.0) -> tuple[JobInfo, float]:
        return wait_for_value(
            f"job {job_id} RUNNING",
            lambda: self.client.job(job_id),
            lambda job: job.state.value == "RUNNING",
            timeout_s,
        )

    def drain(self, node: str, reason: str) -> None:
        self.resume_after(node)
        self.client.drain(node, reason)

    def resume_after(self, node: str) -> None:
        """Resume ``node`` when the test ends: for a test that drains it through the client."""
        self._drained.add(node)

    def kill_node(self, node: str) -> None:
        self._killed.add(node)
        self._script("kill-node", node)

    @contextlib.contextmanager
    def slurmd_stopped(self, node: str) -> Iterator[None]:
        """``node``'s slurmd stopped (SIGSTOP) while the body runs, continued (SIGCONT) on
        leaving, pass or fail. Its steps run on; Slurm soon calls the node not responding, and
        DOWN after SlurmdTimeout (5 s here) of silence."""
        pid = int((self._root / "run" / f"slurmd-{node}.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def revive(self, node: str) -> None:
        self._script("revive", node)
        self._killed.discard(node)

    def freeze_node(self, node: str) -> None:
        """The whole node hangs (SIGSTOP of its slurmd, step daemons and their children):
        nothing of it answers, nothing closes a socket. Thawed by the undo, pass or fail."""
        self._frozen.add(node)
        self._script("freeze-node", node)

    def thaw_node(self, node: str) -> None:
        self._script("thaw-node", node)
        self._frozen.discard(node)

    def _script(self, *args: str) -> None:
        subprocess.run(
            [str(CLUSTER_SCRIPT), *args], env=self._script_env, check=True,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def undo(self) -> None:
        for node in sorted(self._frozen):
            self.thaw_node(node)
        for job_id in self._jobs:
            with contextlib.suppress(SlurmError):
                self.client.cancel(job_id)
        for node in sorted(self._killed):
            self.revive(node)
        for node in sorted(self._drained | self._killed):
            with contextlib.suppress(SlurmBadRequest):  # already back in service
                self.client.resume(node)
        # Idle, not merely schedulable: a cancelled job may still be completing on its nodes.
        wait_for_value(
            "every node idle again",
            lambda: {name: str(info.status) for name, info in self.client.nodes().items()},
            lambda statuses: all(status == "IDLE" for status in statuses.values()),
        )
