"""What the controller relies on from the Slurm client, as one contract with two sides: the
recorded real output (tests/fixtures/slurm/, replayed with its argv checked; runs anywhere)
and the real local cluster (marked `slurm`). The same assertions run against both
(slurm_sides.py), so the fake the unit tests use cannot drift from the real commands; the tests
below the contract need the real cluster alone.

Measured facts behind these tests: docs/measured/local-slurm.md (SlurmdTimeout=5,
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
from slurm_sides import UNKNOWN_JOB, LiveSlurm, RecordedSlurm, SlurmSide, agent_step
from support.waiting import wait_for_value

from slurmft.slurm.api import (
    SignalTarget,
    SlurmBadRequest,
    SlurmJobNotFound,
    SlurmUnreachable,
    SubmitRequest,
)
from slurmft.slurm.hostlist import compress, expand
from slurmft.slurm.script import job_name_for, render_batch_script, run_id_from_comment
from slurmft.slurm.states import JobState


@pytest.fixture(params=["recorded", pytest.param("cluster", marks=pytest.mark.slurm)])
def slurm(request: pytest.FixtureRequest) -> SlurmSide:
    if request.param == "recorded":
        return RecordedSlurm()
    return LiveSlurm(request.getfixturevalue("cluster"), request.getfixturevalue("slurm_conf"))


# --- the contract: the recorded output and the real cluster --------------------------------


def test_version(slurm: SlurmSide) -> None:
    assert slurm.client.version().major >= 22


def test_a_running_job_reads_alike_in_squeue_and_scontrol(slurm: SlurmSide) -> None:
    running = slurm.running_job()
    job = slurm.client.job(running.job_id)
    assert job.state is JobState.RUNNING and len(job.nodes) == 3
    assert job.batch_host in job.nodes
    assert run_id_from_comment(job.comment) == running.run_id
    listed = slurm.client.jobs([running.job_id, *running.others])
    assert UNKNOWN_JOB not in listed  # asked together with known jobs: simply absent
    mine = listed[running.job_id]
    assert (mine.state, mine.nodes, mine.batch_host) == (job.state, job.nodes, job.batch_host)
    assert not slurm.client.batch_host_down(running.job_id)


def test_an_unknown_job_is_absent_from_the_list_and_not_found_alone(slurm: SlurmSide) -> None:
    assert slurm.client.jobs([UNKNOWN_JOB]) == {}
    with pytest.raises(SlurmJobNotFound):
        slurm.client.job(UNKNOWN_JOB)


def test_drain_with_a_reason_reads_back_exactly(slurm: SlurmSide) -> None:
    node, reason = slurm.node_to_drain()
    slurm.client.drain(node, reason)
    for info in (slurm.client.nodes()[node], slurm.client.node(node)):
        assert info.status.drain_requested and not info.status.schedulable, info.status
        assert info.reason == reason
        assert info.reason_user == "root"


def test_drain_of_an_unknown_node_is_a_bad_request(slurm: SlurmSide) -> None:
    with pytest.raises(SlurmBadRequest):
        slurm.client.drain("nosuchnode", "x")


def test_a_killed_batch_host_is_down_and_its_no_kill_job_runs_on(slurm: SlurmSide) -> None:
    running = slurm.running_job()
    job = slurm.client.job(running.job_id)
    slurm.kill_node(job.batch_host, running.job_id)
    node = slurm.client.node(job.batch_host)
    assert node.status.down and node.status.lost and not node.status.schedulable
    assert slurm.client.nodes()[job.batch_host].status.down
    shrunk = slurm.client.job(running.job_id)
    # Slurm itself still calls it RUNNING: only the batch host's state tells the truth.
    assert shrunk.state is JobState.RUNNING and shrunk.batch_host == job.batch_host
    assert set(shrunk.nodes) == set(job.nodes) - {job.batch_host}
    assert slurm.client.batch_host_down(running.job_id)


def test_requeue_with_a_node_excluded_runs_without_it(slurm: SlurmSide) -> None:
    running = slurm.running_job()
    bad = slurm.client.job(running.job_id).nodes[1]
    slurm.client.requeue(running.job_id, exclude=[bad])
    slurm.wait_rerun(running.job_id)
    rerun = slurm.client.job(running.job_id)
    assert rerun.state is JobState.RUNNING and rerun.restarts >= 1
    assert bad not in rerun.nodes and len(rerun.nodes) == 3
    assert rerun.excluded_nodes == (bad,)


def test_an_unreachable_controller_is_never_an_empty_answer(slurm: SlurmSide) -> None:
    away, jobs = slurm.unreachable()
    with pytest.raises(SlurmUnreachable):
        away.jobs(jobs)  # never "no such jobs"
    with pytest.raises(SlurmUnreachable):
        away.drain("n1", "x")


def test_refused_before_reaching_slurm(slurm: SlurmSide) -> None:
    """On the recorded side no command is recorded for these: one that ran would fail."""
    request = SubmitRequest(script=render_batch_script(["true"]), job_name="a'; touch /tmp/x",
                            run_id="refused", nodes=1)  # fmt: skip
    with pytest.raises(SlurmBadRequest):
        slurm.client.submit(request)
    with pytest.raises(SlurmBadRequest):
        slurm.client.drain("n1 State=RESUME", "x")


# --- the real cluster alone ------------------------------------------------------------------


def nodes_that_ran(directory: Path) -> set[str]:
    return {path.name.removeprefix("ran-on-") for path in directory.glob("ran-on-*")}


@pytest.mark.slurm
def test_a_job_runs_on_the_nodes_slurm_reports_and_not_the_excluded(cluster: Cluster) -> None:
    job_id = cluster.submit(agent_step(3, cluster.tmp_path), nodes=2, spare_nodes=1,
                            run_id="contract-3n", exclude=("n1",))  # fmt: skip
    job, _ = cluster.wait_running(job_id)
    assert len(job.nodes) == 3 and "n1" not in job.nodes
    wait_for_value(
        "3 tasks to start", lambda: nodes_that_ran(cluster.tmp_path), lambda s: len(s) == 3
    )
    assert nodes_that_ran(cluster.tmp_path) == set(job.nodes)


@pytest.mark.slurm
def test_resume_brings_a_drained_node_back(cluster: Cluster) -> None:
    cluster.drain("n4", "slurmft: test")
    assert cluster.client.nodes(["n4"])["n4"].status.drain_requested  # the one-node query too
    cluster.client.resume("n4")
    # Right after RESUME slurmctld reads the node as `idle*` until its slurmd answers a ping.
    wait_for_value("n4 back", lambda: cluster.client.node("n4"), lambda n: n.status.schedulable, 10)


@pytest.mark.slurm
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
    assert not cluster.client.batch_host_down(job_id)  # its batch host lives
    print(f"kill -> {victim} DOWN: {seconds:.1f} s")


TASKS_OF = "SLURMFT_TEST_TASKS_OF"  # marks one test's tasks: every worker's cluster has an n2


def _task_states(node: str, marker: str) -> set[str]:
    """The process states (R, S, T, ...) of the `sleep` tasks that run on ``node`` with
    ``TASKS_OF=marker`` in their environment. Nodes are named alike in every cluster of the
    suite's workers, so the node's name alone would count another test's tasks (seen: a
    frozen node's task sleeping, which was another cluster's)."""
    wanted = {f"SLURMD_NODENAME={node}".encode(), f"{TASKS_OF}={marker}".encode()}
    states = set()
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or (entry / "comm").read_text().strip() != "sleep":
                continue
            if wanted <= set((entry / "environ").read_bytes().split(b"\0")):
                states.add((entry / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue  # exited while we looked
    return states


@pytest.mark.slurm
def test_a_frozen_node_stops_answering_and_its_tasks_run_on_when_thawed(cluster: Cluster) -> None:
    marker = str(cluster.tmp_path)
    job_id = cluster.submit(agent_step(3, cluster.tmp_path), nodes=3, env={TASKS_OF: marker})
    job, _ = cluster.wait_running(job_id)
    victim = next(node for node in job.nodes if node != job.batch_host)
    wait_for_value(f"the task on {victim}", lambda: _task_states(victim, marker), bool, 15)
    cluster.freeze_node(victim)
    assert _task_states(victim, marker) == {"T"}
    node, seconds = wait_for_value(
        f"{victim} not responding", lambda: cluster.client.node(victim), lambda n: n.status.lost, 30
    )
    cluster.thaw_node(victim)
    states, _ = wait_for_value(
        f"the task on {victim} running again", lambda: _task_states(victim, marker), bool, 10
    )
    assert "T" not in states
    print(f"freeze -> {victim} {node.status}: {seconds:.1f} s")


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


@pytest.mark.slurm
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


@pytest.mark.slurm
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


@pytest.mark.slurm
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


@pytest.mark.slurm
def test_cluster_up_again_is_harmless(slurm_conf: Path) -> None:
    root = slurm_conf.parents[1]
    env = {**os.environ, "SLURMFT_CLUSTER_ROOT": str(root)}
    pid_before = (root / "run" / "slurmctld.pid").read_text()
    script = str(Path(__file__).resolve().parents[3] / "scripts" / "slurm-cluster")
    again = subprocess.run([script, "up"], env=env, capture_output=True, text=True, check=True)
    assert again.stdout.splitlines() == [f"export SLURM_CONF={slurm_conf}"]  # stdout: one line
    assert (root / "run" / "slurmctld.pid").read_text() == pid_before  # nothing restarted
