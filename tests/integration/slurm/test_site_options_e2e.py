"""Site options on the real cluster (issue 15): GPUs (a count per node, scripts/slurm-cluster's
gres.conf), an account, a constraint (a feature on every other node), --exclusive, one
--sbatch-arg and one --srun-arg. Slurm's own record shows them on the job, the job runs only on
featured nodes, and every agent step holds gres/gpu on each node, also after a spare took a
lost node's place. Slurm gives a step no GRES it does not ask for (not even under --exclusive
--gres=gpu:2), which is why slurmft's steps name them.

A GPU run keeps its GPUs, its --python, its --env and its setup line through a requeue and a
resubmission. Slurm 22.05 breaks the GPU allocation of a job requeued while it still holds a
lost node that Slurm has not yet marked DOWN: every step that asks for GPUs fails ("Invalid
generic resource (gres) specification"; slurmctld: "_step_get_gres_cnt ... node offset
invalid"), and the GPUs of its new nodes stay allocated after it ends (docs/slurm.md has the
reproduction). So the daemon sets such a node DOWN before the requeue (unit-tested in
test_decide), and this test checks the requeued job's GPU steps."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import IDENTITY_TRAIN, TINY, SubmittedRun, second_venv, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.models import ActionKind, ActionStatus
from slurmft.db.states import RunState
from slurmft.slurm.parse import parse_scontrol_records

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]
FEATURED = {"n2", "n4", "n6"}  # scripts/slurm-cluster: Features=featured on every other node
GPUS = 2  # scripts/slurm-cluster: gpu:2 on every node


def show(*what: str) -> list[dict[str, str]]:
    done = subprocess.run(["scontrol", "-o", "show", *what], capture_output=True, text=True,
                          check=True, timeout=30)  # fmt: skip
    return parse_scontrol_records(done.stdout)


def agent_steps(job_id: str) -> list[dict[str, str]]:
    return [s for s in show("step", job_id) if s.get("StepId", "").split(".")[-1].isdigit()]


def holds_gpus(step: dict[str, str]) -> bool:
    """The step's GPUs per node, as 22.05 shows them (`TresPerNode=gres:gpu:2`; its `TRES`
    lists GPUs only where accounting tracks them, which needs slurmdbd)."""
    return f"gres:gpu:{GPUS}" in step.get("TresPerNode", "").split(",")


def ranks_training(run: SubmittedRun, ranks: int) -> dict[int, str]:
    nodes, _ = wait_for_value(f"{ranks} ranks reporting", run.beating_nodes,
                              lambda found: len(found) == ranks, timeout_s=180)  # fmt: skip
    return nodes


def test_gpus_account_constraint_and_passthrough_reach_the_job_and_every_agent_step(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(
        cluster, daemon, tmp_path, [*EXAMPLE, *TINY], name="site", nodes=2, spares=1,
        fields={"gpus_per_node": GPUS, "account": "ml", "constraint": "featured",
                "exclusive": True, "sbatch_args": ["--mail-type=END"],
                "srun_args": ["--job-name=slurmft-agents"]},
    )  # fmt: skip
    nodes = ranks_training(run, ranks=2 * GPUS)  # nproc-per-node gpu: SLURM_GPUS_ON_NODE
    (job,) = show("job", run.job_id)
    assert (job["Account"], job["Features"], job["MailType"]) == ("ml", "featured", "END"), job
    assert job["TresPerNode"] == f"gres:gpu:{GPUS}" and job["OverSubscribe"] == "NO", job
    assert set(cluster.client.job(run.job_id).nodes) == FEATURED  # 2 + 1 spare: all three
    (step,) = agent_steps(run.job_id)
    assert step["Name"] == "slurmft-agents" and holds_gpus(step), step

    # A training node lost: the spare takes its place inside the same step and allocation.
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(nodes.values()) - {batch_host})[0]
    cluster.kill_node(victim)
    wait_for_value(
        "the spare training in the lost node's place", run.beating_nodes,
        lambda found: len(found) == 2 * GPUS and victim not in found.values(), timeout_s=180,
    )  # fmt: skip
    steps = agent_steps(run.job_id)
    assert steps and all(holds_gpus(s) for s in steps), steps
    wait_for_value("the run to complete", lambda: run.run().state,
                   lambda state: state is RunState.COMPLETED, timeout_s=240)  # fmt: skip
    run.database.dispose()


def test_an_exclusive_job_with_a_gres_gives_it_to_its_agent_steps(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Under --exclusive the job holds every GPU of its nodes, but a step gets none unasked."""
    run = submit(
        cluster, daemon, tmp_path, [*EXAMPLE, "--steps", "30", "--ckpt-every", "5"],
        name="exclusive", nodes=2, spares=0,
        fields={"gres": f"gpu:{GPUS}", "exclusive": True, "nproc_per_node": 1},
    )  # fmt: skip
    ranks_training(run, ranks=2)
    (step,) = agent_steps(run.job_id)
    assert holds_gpus(step), step
    wait_for_value("the run to complete", lambda: run.run().state,
                   lambda state: state is RunState.COMPLETED, timeout_s=240)  # fmt: skip
    run.database.dispose()


def workers_of(run: SubmittedRun, job_id: str, restart: str, ranks: int) -> list[dict[str, str]]:
    """The identity records of one attempt's workers, once ``ranks`` of them started."""

    def records() -> list[dict[str, str]]:
        rows = run.jsonl("identity.jsonl")
        return [r for r in rows if (r["job"], r["restart"]) == (job_id, restart)]

    found, _ = wait_for_value(f"{ranks} workers of job {job_id} (restart {restart})", records,
                              lambda rows: len(rows) >= ranks, timeout_s=120)  # fmt: skip
    return found


def test_a_gpu_run_keeps_its_gpus_and_environment_through_a_requeue_and_a_resubmission(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    python = second_venv(tmp_path / "venv2")
    script = [IDENTITY_TRAIN, "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", *TINY, "--steps", "150"]
    run = submit(
        cluster, daemon, tmp_path, script, name="gpu-requeue", nodes=2, spares=0,
        env={"SLURMFT_E2E_MARK": "from --env"},
        fields={"gpus_per_node": GPUS, "nproc_per_node": 1, "python": str(python),
                "setup": ["export SLURMFT_E2E_SETUP=from-setup"]},
    )  # fmt: skip
    workers_of(run, run.job_id, "0", ranks=2)

    # The batch host lost: DOWN before the requeue, so that the requeued job's agent step gets
    # its GPUs. The daemon sets it DOWN once it sees the node silent (about 4 s after the kill
    # here); Slurm's own DOWN comes about 9 s after it, and on a loaded machine it may come
    # first. Either way the requeued job's GPU steps are what shows it was DOWN in time.
    host = cluster.client.job(run.job_id).batch_host
    cluster.kill_node(host)
    killed_at = time.monotonic()
    requeued, running_s = wait_for_value(
        "the job requeued without its batch host", lambda: cluster.client.job(run.job_id),
        lambda job: job.restarts == 1 and job.state.value == "RUNNING", timeout_s=90,
    )  # fmt: skip
    assert host not in requeued.nodes
    fences = [a for a in run.actions() if a.kind is ActionKind.EVICT_NODE and a.node == host]
    assert len(fences) <= 1, fences  # once per job and node
    for fence in fences:
        assert fence.status is ActionStatus.DONE and fence.reason.startswith(
            f"slurmft: node {host} silent (slurmd not responding)"
        ), (fence.status, fence.reason, fence.error)
    workers_of(run, run.job_id, "1", ranks=2)
    down_by = "the daemon" if fences else "Slurm (before the daemon's pass)"
    print(f"\nbatch host {host} killed: set DOWN by {down_by}; requeued and RUNNING "
          f"{running_s:.1f} s after the kill, workers started "
          f"{time.monotonic() - killed_at:.1f} s after it")  # fmt: skip
    steps = agent_steps(run.job_id)
    assert steps and all(holds_gpus(s) for s in steps), steps

    # Preempted: a new job, submitted again as the owner, gets its GPUs too.
    cluster.preempt(requeued.nodes[0])
    attempts, _ = wait_for_value(
        "the daemon to submit the run's job again", run.attempts,
        lambda rows: rows[-1].slurm_job_id not in (None, run.job_id), timeout_s=90,
    )  # fmt: skip
    resubmitted = str(attempts[-1].slurm_job_id)
    cluster._jobs.append(resubmitted)  # cancelled by the fixture whatever happens
    workers_of(run, resubmitted, "0", ranks=2)
    steps = agent_steps(resubmitted)
    assert steps and all(holds_gpus(s) for s in steps), steps
    wait_for_value("the run to complete", lambda: run.run().state,
                   lambda state: state is RunState.COMPLETED, timeout_s=240)  # fmt: skip

    records = run.jsonl("identity.jsonl")
    assert {(r["job"], r["restart"]) for r in records} >= {
        (run.job_id, "0"), (run.job_id, "1"), (resubmitted, "0")
    }, records  # fmt: skip
    for record in records:
        assert (record["executable"], record["mark"], record["from_setup"]) == (
            str(python), "from --env", "from-setup"
        ), record  # fmt: skip
        assert record["gpus"] == str(GPUS), record
    run.database.dispose()
