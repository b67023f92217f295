"""The Slurm client against the real local cluster: what the controller relies on.

Measured facts behind these tests: shared/notes/local-slurm.md (SlurmdTimeout=5,
MessageTimeout=2: a killed node is NOT_RESPONDING after ~5 s and DOWN after ~10 s).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.slurm.api import SignalTarget, SlurmBadRequest, SlurmJobNotFound, SlurmUnreachable
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.hostlist import compress, expand
from slurmft.slurm.script import job_name_for, run_id_from_comment
from slurmft.slurm.states import JobState

pytestmark = pytest.mark.slurm


# Every task records the node it ran on, then stays up until cancelled.
def report_node_then_sleep(directory: Path) -> list[str]:
    return ["bash", "-c", f'touch "{directory}/ran-on-$SLURMD_NODENAME"; exec sleep 600']


def agent_step(nodes: int, directory: Path) -> list[str]:
    """The step the agents would be: survives the loss of one of its nodes."""
    return [
        "srun", "--no-kill", "--kill-on-bad-exit=0", f"-N{nodes}", f"-n{nodes}",
        *report_node_then_sleep(directory),
    ]  # fmt: skip


def nodes_that_ran(directory: Path) -> set[str]:
    return {path.name.removeprefix("ran-on-") for path in directory.glob("ran-on-*")}


def test_version(client: CliSlurmClient) -> None:
    assert client.version().major >= 22


def test_three_node_job_runs_on_the_nodes_slurm_reports(cluster: Cluster) -> None:
    job_id = cluster.submit(agent_step(3, cluster.tmp_path), nodes=2, spare_nodes=1,
                            run_id="contract-3n", exclude=("n1",))  # fmt: skip
    job, _ = cluster.wait_running(job_id)
    assert len(job.nodes) == 3 and "n1" not in job.nodes
    assert job.batch_host in job.nodes
    assert run_id_from_comment(job.comment) == "contract-3n"
    wait_for_value(
        "3 tasks to start", lambda: nodes_that_ran(cluster.tmp_path), lambda s: len(s) == 3
    )
    assert nodes_that_ran(cluster.tmp_path) == set(job.nodes)
    # The batched query agrees with the detailed one.
    assert cluster.client.jobs([job_id])[job_id].nodes == job.nodes
    assert not cluster.client.batch_host_down(job_id)


def test_drain_with_a_reason_reads_back_exactly(cluster: Cluster) -> None:
    reason = 'slurmft: xid 79 on GPU 3 (run "it\'s"; $(id) | `x` Foo=bar)'
    cluster.drain("n4", reason)
    listed = cluster.client.nodes(["n4"])["n4"]
    detail = cluster.client.node("n4")
    for info in (listed, detail):
        assert info.status.drain_requested and not info.status.schedulable, info.status
        assert info.reason == reason
        assert info.reason_user == "root"
    cluster.client.resume("n4")
    # Right after RESUME slurmctld reads the node as `idle*` until its slurmd answers a ping.
    wait_for_value("n4 back", lambda: cluster.client.node("n4"), lambda n: n.status.schedulable, 10)


def test_killed_node_goes_down_and_the_no_kill_job_shrinks(cluster: Cluster) -> None:
    job_id = cluster.submit(agent_step(3, cluster.tmp_path), nodes=3)
    job, _ = cluster.wait_running(job_id)
    victim = next(node for node in job.nodes if node != job.batch_host)
    cluster.kill_node(victim)
    node, seconds = wait_for_value(
        f"{victim} DOWN", lambda: cluster.client.node(victim), lambda n: n.status.down, 30
    )
    assert node.status.lost and not node.status.schedulable
    shrunk, _ = wait_for_value(
        f"job {job_id} to shrink",
        lambda: cluster.client.job(job_id),
        lambda j: victim not in j.nodes,
        15,
    )
    assert shrunk.state is JobState.RUNNING
    assert set(shrunk.nodes) == set(job.nodes) - {victim}
    assert not cluster.client.batch_host_down(job_id)
    print(f"kill -> {victim} DOWN: {seconds:.1f} s")


def test_requeue_with_a_node_excluded_runs_without_it(cluster: Cluster) -> None:
    job_id = cluster.submit(agent_step(3, cluster.tmp_path), nodes=3)
    job, _ = cluster.wait_running(job_id)
    bad = job.nodes[1]
    cluster.client.requeue(job_id, exclude=[bad])
    rerun, seconds = wait_for_value(
        f"job {job_id} running again",
        lambda: cluster.client.job(job_id),
        lambda j: j.state is JobState.RUNNING and j.restarts == 1,
        40,
    )
    assert bad not in rerun.nodes and len(rerun.nodes) == 3
    assert rerun.excluded_nodes == (bad,)
    print(f"requeue -> running: {seconds:.1f} s")


def test_job_whose_batch_host_died_is_reported(cluster: Cluster) -> None:
    job_id = cluster.submit(agent_step(3, cluster.tmp_path), nodes=3)
    job, _ = cluster.wait_running(job_id)
    assert not cluster.client.batch_host_down(job_id)
    cluster.kill_node(job.batch_host)
    _, seconds = wait_for_value(
        "the dead batch host to be noticed",
        lambda: cluster.client.batch_host_down(job_id),
        lambda down: down,
        30,
    )
    # Slurm itself still calls it RUNNING: only the detection above tells the truth.
    assert cluster.client.job(job_id).state is JobState.RUNNING
    print(f"kill batch host -> detected: {seconds:.1f} s")


HOSTILE = [
    "it's",
    'say "hi"',
    "$(touch {canary})",
    "`touch {canary}`",
    "a; touch {canary}",
    "x && touch {canary}",
    "line1\nline2",
    "| tee {canary}",
    "${{HOME}}",
    "*",
    "",
]


def test_hostile_names_and_arguments_stay_inert(cluster: Cluster, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    args = [arg.format(canary=canary) for arg in HOSTILE]
    run_name = f'run "$(touch {canary})"; `id`\nnext line'
    out = tmp_path / "args.json"
    dump_args = "import json, sys; print(json.dumps(sys.argv[1:]))"
    job_id = cluster.submit(
        ["python3", "-c", dump_args, *args],
        nodes=1,
        job_name=job_name_for(run_name),
        env={"RUN_NAME": run_name},
        output=str(out),
    )
    job, _ = wait_for_value(
        f"job {job_id} to finish",
        lambda: cluster.client.jobs([job_id]).get(job_id),
        lambda j: j is not None and j.state.is_ended,
        30,
    )
    assert job is not None and job.state is JobState.COMPLETED
    assert json.loads(out.read_text()) == args
    assert not canary.exists()
    assert job.name == job_name_for(run_name)


def test_refused_before_reaching_slurm(cluster: Cluster) -> None:
    with pytest.raises(SlurmBadRequest):
        cluster.submit(["true"], nodes=1, job_name="a'; touch /tmp/x")
    with pytest.raises(SlurmBadRequest):
        cluster.client.drain("n1 State=RESUME", "x")


def test_unknown_job_and_unreachable_controller(
    client: CliSlurmClient, slurm_conf: Path, tmp_path: Path
) -> None:
    assert client.jobs(["999999"]) == {}
    with pytest.raises(SlurmJobNotFound):
        client.job("999999")
    unreachable = tmp_path / "slurm.conf"
    unreachable.write_text(
        "\n".join(
            "SlurmctldPort=9" if line.startswith("SlurmctldPort=") else line
            for line in slurm_conf.read_text().splitlines()
        )
    )
    away = CliSlurmClient(slurm_conf=str(unreachable), timeout_s=20)
    with pytest.raises(SlurmUnreachable):
        away.jobs(["1", "2"])  # never "no such jobs"


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.builds(lambda n, w: f"n{str(n).zfill(w)}", st.integers(0, 120), st.integers(0, 3)),
        min_size=1,
        max_size=20,
    )
)
def test_hostlists_agree_with_scontrol(names: list[str]) -> None:
    expression = compress(names)
    slurm = subprocess.run(
        ["scontrol", "show", "hostnames", expression], capture_output=True, text=True, check=True
    )
    assert sorted(slurm.stdout.split()) == sorted(expand(expression)) == sorted(set(names))


def test_signal_reaches_steps_or_batch_shell(cluster: Cluster) -> None:
    d = cluster.tmp_path
    batch_shell = (
        f"trap 'touch {d}/batch-usr1' USR1\n"
        f'srun -N1 -n1 bash -c \'trap "touch {d}/step-usr1" USR1; touch {d}/step-ready;'
        " while true; do sleep 0.1; done' &\n"
        "while true; do sleep 0.1; done\n"
    )
    job_id = cluster.submit(["bash", "-c", batch_shell], nodes=1)
    wait_for_value("the step", (d / "step-ready").exists, lambda ready: ready, 30)
    cluster.client.signal(job_id, "USR1", SignalTarget.STEPS)
    wait_for_value("USR1 in the step", (d / "step-usr1").exists, lambda got: got, 10)
    assert not (d / "batch-usr1").exists()  # measured on 22.05: steps only
    cluster.client.signal(job_id, "USR1", SignalTarget.BATCH)
    wait_for_value("USR1 in the batch shell", (d / "batch-usr1").exists, lambda got: got, 10)


def test_cluster_up_again_is_harmless(slurm_conf: Path) -> None:
    root = slurm_conf.parents[1]
    env = {**os.environ, "SLURMFT_CLUSTER_ROOT": str(root)}
    pid_before = (root / "run" / "slurmctld.pid").read_text()
    script = str(Path(__file__).resolve().parents[3] / "scripts" / "slurm-cluster")
    again = subprocess.run([script, "up"], env=env, capture_output=True, text=True, check=True)
    assert again.stdout.splitlines() == [f"export SLURM_CONF={slurm_conf}"]  # stdout: one line
    assert (root / "run" / "slurmctld.pid").read_text() == pid_before  # nothing restarted
