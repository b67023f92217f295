"""The two sides of the Slurm client contract (test_slurm_contract.py): the recorded cluster
(real Slurm 22.05 output, tests/fixtures/slurm/, replayed with its argv checked) and the real
local cluster. Each brings the cluster into a state the contract asks for and hands back a
client that sees it: the recorded side by moving to the moment that state was recorded in,
the live side by doing it and waiting until Slurm says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from local_cluster import Cluster
from support.slurm_recordings import RecordedCluster, job_id_of, jobs_asked, load_recording
from support.waiting import wait_for_value

from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.script import run_id_from_comment
from slurmft.slurm.states import JobState

UNKNOWN_JOB = "999999"


@dataclass(frozen=True)
class RunningJob:
    """A three-node --no-kill job, running; ``others`` are asked about in the same squeue."""

    job_id: str
    run_id: str
    others: tuple[str, ...]


class SlurmSide(Protocol):
    client: CliSlurmClient

    def running_job(self) -> RunningJob:
        """Submit (or find) a three-node job and wait until it runs."""

    def node_to_drain(self) -> tuple[str, str]:
        """An idle node and the reason to drain it with (the test drains it)."""

    def kill_node(self, node: str, job_id: str) -> None:
        """Kill ``node`` under the job; return once Slurm has it DOWN and out of the job."""

    def wait_rerun(self, job_id: str) -> None:
        """Return once the requeued job runs again."""

    def unreachable(self) -> tuple[CliSlurmClient, list[str]]:
        """A client whose slurmctld does not answer, and jobs to ask it about."""


# Every task records the node it ran on, then stays up until cancelled.
def report_node_then_sleep(directory: Path) -> list[str]:
    return ["bash", "-c", f'touch "{directory}/ran-on-$SLURMD_NODENAME"; exec sleep 600']


def agent_step(nodes: int, directory: Path) -> list[str]:
    """The step the agents would be: survives the loss of one of its nodes."""
    return [
        "srun", "--no-kill", "--kill-on-bad-exit=0", f"-N{nodes}", f"-n{nodes}",
        *report_node_then_sleep(directory),
    ]  # fmt: skip


class RecordedSlurm:
    """tests/fixtures/slurm/record.py's cluster: its running job on n1-n3 (batch host n1), then n1
    killed, then the job requeued without n2; n6 drained with a hostile reason."""

    # Answers that hold at every moment of the recording.
    ALWAYS = ("sinfo_version", "squeue_unknown_single", "show_job_unknown", "drain_unknown_node")

    def __init__(self) -> None:
        self.runner = RecordedCluster(self.ALWAYS)
        self.client = CliSlurmClient(self.runner)

    def _at(self, *names: str) -> None:
        self.runner.at(*self.ALWAYS, *names)

    def running_job(self) -> RunningJob:
        # While it ran: both queries, its batch host, and what a requeue and the update of its
        # excluded nodes (to n2) answered.
        self._at("show_job_running", "squeue_many", "show_node_allocated",
                 "requeue", "update_exclude_held")  # fmt: skip
        job_id = job_id_of(load_recording("show_job_running"))
        comment = next(a for a in load_recording("sbatch_parsable").argv if "--comment=" in a)
        others = [job for job in jobs_asked(load_recording("squeue_many")) if job != job_id]
        run_id = run_id_from_comment(comment.removeprefix("--comment="))
        assert run_id is not None
        return RunningJob(job_id, run_id, tuple(others))

    def node_to_drain(self) -> tuple[str, str]:
        self._at("drain_idle", "sinfo_nodes_drained", "show_node_drained")
        drain = load_recording("drain_idle").argv  # scontrol update NodeName=n6 ... Reason=...
        return drain[2].removeprefix("NodeName="), drain[4].removeprefix("Reason=")

    def kill_node(self, node: str, job_id: str) -> None:
        killed = load_recording("show_node_down").argv[-1]
        assert node == killed, f"only the death of {killed}, the batch host, was recorded"
        self._at("show_job_batch_host_down", "show_node_down", "sinfo_nodes_down")

    def wait_rerun(self, job_id: str) -> None:
        self._at("show_job_rerun_excluded")

    def unreachable(self) -> tuple[CliSlurmClient, list[str]]:
        away = CliSlurmClient(RecordedCluster(["squeue_unreachable", "drain_unreachable"]))
        return away, jobs_asked(load_recording("squeue_unreachable"))


class LiveSlurm:
    """The real local cluster; what a test does to it is undone by the Cluster afterwards."""

    def __init__(self, cluster: Cluster, slurm_conf: Path) -> None:
        self.cluster, self.slurm_conf = cluster, slurm_conf
        self.client = cluster.client

    def running_job(self) -> RunningJob:
        job_id = self.cluster.submit(agent_step(3, self.cluster.tmp_path), nodes=2,
                                     spare_nodes=1, run_id="contract-3n")  # fmt: skip
        self.cluster.wait_running(job_id)
        return RunningJob(job_id, "contract-3n", (UNKNOWN_JOB,))

    def node_to_drain(self) -> tuple[str, str]:
        self.cluster.resume_after("n4")
        return "n4", 'slurmft: xid 79 on GPU 3 (run "it\'s"; $(id) | `x` Foo=bar)'

    def kill_node(self, node: str, job_id: str) -> None:
        killed = time.monotonic()
        self.cluster.kill_node(node)
        client = self.client
        wait_for_value(f"{node} DOWN", lambda: client.node(node), lambda n: n.status.down, 30)
        wait_for_value(
            f"job {job_id} without {node}", lambda: client.job(job_id),
            lambda job: node not in job.nodes, 15,
        )  # fmt: skip
        print(f"kill {node} -> DOWN and out of the job: {time.monotonic() - killed:.1f} s")

    def wait_rerun(self, job_id: str) -> None:
        _, seconds = wait_for_value(
            f"job {job_id} running again",
            lambda: self.client.job(job_id),
            lambda j: j.state is JobState.RUNNING and j.restarts == 1,
            40,
        )
        print(f"requeue -> running: {seconds:.1f} s")

    def unreachable(self) -> tuple[CliSlurmClient, list[str]]:
        conf = self.cluster.tmp_path / "unreachable-slurm.conf"
        conf.write_text(
            "\n".join(
                "SlurmctldPort=9" if line.startswith("SlurmctldPort=") else line
                for line in self.slurm_conf.read_text().splitlines()
            )
        )
        return CliSlurmClient(slurm_conf=str(conf), timeout_s=20), ["1", "2"]
