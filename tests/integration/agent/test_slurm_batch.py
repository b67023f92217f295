"""The batch script on a real Slurm cluster (its own 4 nodes, so killing one disturbs no one).

A node kill: the spare takes over inside the same Slurm step (the step id does not change), and
the surviving agents live on when Slurm marks the dead node DOWN (srun --no-kill). A dead
rendezvous store: every agent exits, the batch step relaunches the agent step on the healthy
nodes, and training resumes from the last checkpoint. A time limit: Slurm's USR1 before it leads
to a coordinated save, a requeue by the job itself and an exact resume. A script that always
crashes, with no daemon: torchrun restarts it in place inside one agent step, and the batch step
stops it at the restart budget's cap from what the agents recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slurm_clusters import CLUSTER_SCRIPT, own_cluster
from support.processes import argv_of, is_worker
from support.waiting import wait_for
from unix_users import TestUsers, UnixUser

from slurmft.agent.batch import BatchSpec, checkpoint_step, newest_checkpoint, submit_request
from slurmft.agent.sightings import read_step
from slurmft.core.budget import Seen
from slurmft.core.exits import BatchExit
from slurmft.slurm.api import JobInfo, SlurmError
from slurmft.slurm.cli_backend import CliSlurmClient

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

SLURMFT = str(Path(sys.executable).parent / "slurmft")
NODES = ["n1", "n2", "n3", "n4"]  # the module cluster's; n1 hosts the batch step
TINY_ARGS = [
    "--steps",
    "60",
    "--ckpt-every",
    "5",
    "--work-ms",
    "150",
    "--heartbeat-interval-s",
    "1",
    "--pg-timeout-s",
    "30",
]


@dataclasses.dataclass
class Cluster:
    root: str
    conf: str
    client: CliSlurmClient

    def run(self, *args: str) -> str:
        env = {**os.environ, "SLURMFT_CLUSTER_ROOT": self.root, "SLURM_CONF": self.conf}
        done = subprocess.run(
            [str(CLUSTER_SCRIPT), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return done.stdout

    def squeue(self, *args: str) -> str:
        env = {**os.environ, "SLURM_CONF": self.conf}
        return subprocess.run(
            ["squeue", "-h", *args], env=env, capture_output=True, text=True, timeout=30, check=True
        ).stdout


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with own_cluster(4, prefix="sftc-") as own:
        yield Cluster(own.root, own.conf, CliSlurmClient(slurm_conf=own.conf))


@dataclasses.dataclass
class Job:
    job_id: str
    workdir: Path

    def records(self) -> list[dict[str, Any]]:
        path = self.workdir / "out" / "losses.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def events(self, name: str) -> list[dict[str, Any]]:
        path = self.workdir / "out" / "events.jsonl"
        found = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [e for e in found if e["event"] == name]

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.workdir.glob("job-*.out"))


def submit(
    cluster: Cluster,
    workdir: Path,
    port: int,
    args: list[str] = TINY_ARGS,
    *,
    time_limit: str | None = None,
    save_lead_s: int = 300,
    as_user: UnixUser | None = None,
    max_restarts_without_progress: int = 5,
) -> Job:
    """The batch script of a 3 + 1 run of the example, submitted as root or as ``as_user`` (then
    it runs as them: ``workdir`` must be theirs)."""
    ckpt = str(workdir / "ckpt")
    script = (
        "-m",
        "slurmft.train.examples.tiny",
        "--ckpt-dir",
        ckpt,
        "--out-dir",
        str(workdir / "out"),
        *args,
    )
    spec = BatchSpec(
        run_id=f"t{port}",
        nodes=3,
        spares=1,
        script=script,
        ckpt_dir=ckpt,
        store_port=port,
        slurmft=SLURMFT if as_user is None else as_user.slurmft,
        max_restarts_without_progress=max_restarts_without_progress,
    )
    request = dataclasses.replace(
        submit_request(
            spec,
            job_name="slurmft-agent-test",
            time_limit=time_limit,
            save_lead_s=save_lead_s,
            output=str(workdir / "job-%j.out"),
        ),
        ntasks_per_node=1,
        cpus_per_task=1,
    )
    if as_user is None:
        return Job(cluster.client.submit(request), workdir)
    request = dataclasses.replace(request, workdir=str(workdir))
    return Job(as_user.slurm_client(cluster.conf).submit(request), workdir)


def step_pids(cluster: Cluster, step: str, node: str) -> list[int]:
    """The processes of `step` on `node` (none where the node is dead or the step ended there)."""
    env = {**os.environ, "SLURM_CONF": cluster.conf}
    listed = subprocess.run(
        ["scontrol", "listpids", step, node],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout.split("\n")[1:]
    return [int(line.split()[0]) for line in listed if line.split() and line.split()[0].isdigit()]


def workers_on(cluster: Cluster, step: str, node: str) -> int:
    """Training worker processes of `step` on `node` (an agent, its launcher, then workers)."""
    count = 0
    for pid in step_pids(cluster, step, node):
        try:
            argv = argv_of(pid)
            count += is_worker(pid, argv, "slurmft.train.examples.tiny")
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return count


class StepOverlapWatch:
    """Samples, until stopped, which agent steps have processes on which node, and keeps every
    sample where two steps ran on one node at once (two agents of one run on one node)."""

    def __init__(self, cluster: Cluster, job: Job):
        self.cluster, self.job = cluster, job
        self.overlaps: list[tuple[str, list[str]]] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StepOverlapWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            steps = steps_of(self.cluster, self.job)
            for node in NODES:
                busy = [s for s in steps if step_pids(self.cluster, s, node)]
                if len(busy) > 1:
                    self.overlaps.append((node, busy))
            self.samples += 1


def steps_of(cluster: Cluster, job: Job) -> list[str]:
    return sorted(
        s
        for s in cluster.squeue("-s", "-j", job.job_id, "-o", "%i").split()
        if not s.endswith(".batch")
    )


def assert_replays_match(job: Job, steps: int = 60) -> None:
    """Steps computed twice (before a failure and after the resume) gave the same loss."""
    seen: dict[int, float] = {}
    for record in job.records():
        assert record["world_size"] == 3
        assert math.isfinite(record["loss"]), record
        if record["step"] in seen:
            assert record["loss"] == pytest.approx(seen[record["step"]], rel=1e-5), record
        seen[record["step"]] = record["loss"]
    assert sorted(seen) == list(range(1, steps + 1))


def test_node_kill_spare_takes_over_inside_the_same_step(
    cluster: Cluster, tmp_path: Path, free_port: int
) -> None:
    # 160 steps: still training when the batch step sees Slurm's DOWN (about 12 s after the
    # kill; the spare trains 3 s after it), so the restart is charged with its node's loss.
    args = [*TINY_ARGS, "--steps", "160"]
    node_kill_inside_the_same_step(cluster, submit(cluster, tmp_path, free_port, args), steps=160)


@pytest.fixture
def slurmd_timeout_60(cluster: Cluster) -> Iterator[None]:
    """A slower DOWN, as at a site (SlurmdTimeout=300 there): the spare has long taken over
    when Slurm marks the node DOWN, and the step must survive that moment."""
    conf = Path(cluster.conf)
    original = conf.read_text()
    assert "SlurmdTimeout=5\n" in original
    env = {**os.environ, "SLURM_CONF": cluster.conf}
    conf.write_text(original.replace("SlurmdTimeout=5\n", "SlurmdTimeout=60\n"))
    subprocess.run(["scontrol", "reconfigure"], env=env, timeout=60, check=True)
    try:
        yield
    finally:
        conf.write_text(original)
        subprocess.run(["scontrol", "reconfigure"], env=env, timeout=60, check=True)


def test_node_kill_with_slurmd_timeout_60(
    cluster: Cluster, tmp_path: Path, free_port: int, slurmd_timeout_60: None
) -> None:
    # Long enough that Slurm marks the node DOWN (about 60-70 s after the kill) mid-training.
    args = [*TINY_ARGS, "--steps", "150", "--work-ms", "600"]
    node_kill_inside_the_same_step(cluster, submit(cluster, tmp_path, free_port, args), steps=150)


def kill_an_active_node(cluster: Cluster, job: Job, killed: list[str]) -> tuple[str, str]:
    """Once training runs: SIGKILL a training node other than n1 (it hosts the batch step and
    the store), record it in `killed` for the caller to revive, and wait until the spare trains.
    Returns the agent step and the killed node."""
    wait_for(
        lambda: any(r["step"] >= 12 for r in job.records()),
        180,
        lambda: f"training under Slurm\n{job.output()[-3000:]}",
    )
    (step,) = steps_of(cluster, job)
    active = [n for n in NODES if workers_on(cluster, step, n)]
    (spare,) = set(NODES) - set(active)
    victim = next(n for n in active if n != "n1")
    cluster.run("kill-node", victim)
    killed.append(victim)
    wait_for(
        lambda: workers_on(cluster, step, spare),
        180,
        lambda: f"the spare {spare} to train\n{job.output()[-3000:]}",
    )
    return step, victim


def node_kill_inside_the_same_step(cluster: Cluster, job: Job, steps: int) -> None:
    killed: list[str] = []
    try:
        step, victim = kill_an_active_node(cluster, job, killed)
        assert steps_of(cluster, job) == [step]  # the same step: no relaunch was needed
        wait_for(
            lambda: victim not in cluster.client.job(job.job_id).nodes,
            120,
            "Slurm to mark the node DOWN and shrink the job",
        )
        assert not job.events("done"), "training ended before the DOWN: make it longer"
        wait_for(lambda: job.events("done"), 240, lambda: f"the end\n{job.output()[-3000:]}")
        assert steps_of(cluster, job) in ([step], [])  # survivors were not killed by the DOWN
        assert "agent step 2" not in job.output()
        assert_replays_match(job, steps)
        # The agents recorded the restart, and it was free: its node was taken away.
        seen = {s.kind for s in read_step(str(_step_dir(job, 1)))}
        assert {Seen.FAILURE, Seen.RESTART} <= seen, seen
        assert _budget(job.workdir)["restarts_without_progress"] == 0
    finally:
        cluster.client.cancel(job.job_id)
        for node in killed:
            cluster.run("revive", node)


def test_no_spare_left_a_dead_store_relaunches_on_the_healthy_nodes(
    cluster: Cluster, tmp_path: Path, free_port: int, slurmd_timeout_60: None
) -> None:
    """A node is lost and the spare takes its place (no spare left), then the store dies, which
    ends the agent step: the batch step relaunches it on the three healthy nodes, without the
    lost one, and training resumes. The store dies before Slurm has marked the lost node DOWN,
    while the ended step still holds the healthy nodes' CPUs (srun --overlap), and no two agent
    steps ever run on one node at once. SlurmdTimeout=60 keeps that order: with the suite's 5 s,
    a loaded machine let Slurm mark the node DOWN before the spare had taken over."""
    job = submit(cluster, tmp_path, free_port)
    killed: list[str] = []
    try:
        with StepOverlapWatch(cluster, job) as watch:
            _, victim = kill_an_active_node(cluster, job, killed)
            assert victim in cluster.client.job(job.job_id).nodes, "the job shrank already"
            store = _store_server_pid(free_port)
            os.kill(store, signal.SIGKILL)  # the supervisor restarts it; agents lose their state
            healthy = ",".join(n for n in NODES if n != victim)
            wait_for(
                lambda: f"agent step 2 on {healthy}" in job.output(),
                180,
                lambda: f"an agent step relaunched on {healthy}\n{job.output()[-3000:]}",
            )
            wait_for(lambda: job.events("done"), 240, lambda: f"the end\n{job.output()[-3000:]}")
        assert "Requested nodes are busy" not in job.output()
        assert watch.samples > 10 and not watch.overlaps, watch.overlaps[:5]
        assert job.events("resumed")
        assert_replays_match(job)
    finally:
        cluster.client.cancel(job.job_id)
        for node in killed:
            cluster.run("revive", node)


CRASH_CAP = 3  # the restart budget, lowered from 5 to keep the test short


def test_a_script_that_always_crashes_stops_at_the_cap_without_the_daemon(
    cluster: Cluster, tmp_path: Path, free_port: int
) -> None:
    """Rank 1 dies at step 2 in every attempt, before any checkpoint; torchrun restarts the
    workers in place each time, so the agent step never ends. With no daemon, the batch step
    counts the failures from the agents' records and, at the failure after the cap, stops the
    step and exits with "give up" and the daemon's wording."""
    started = time.monotonic()
    args = [*TINY_ARGS, "--crash-at-step", "2@*", "--fault-rank", "1"]
    job = submit(cluster, tmp_path, free_port, args, max_restarts_without_progress=CRASH_CAP)
    try:
        ended: JobInfo = wait_for(
            lambda: (info := cluster.client.job(job.job_id)).state.is_ended and info,
            360,
            lambda: f"the batch step to give up\n{job.output()[-3000:]}",
        )
        print(f"\ncrash loop stopped after {time.monotonic() - started:.0f} s")
        output = job.output()
        assert ended.exit_code.split(":")[0] == str(int(BatchExit.GIVE_UP)), (ended, output[-3000:])
        assert f"crash loop: {CRASH_CAP} restarts in a row without progress" in output, output
        assert f"the cap is {CRASH_CAP} (policy.max_restarts_without_progress)" in output
        assert "agent step 2" not in output  # stopped inside the one agent step
        # Never a checkpoint: from scratch each time; torchrun goes on restarting for the grace
        # the batch step leaves a daemon (there is none here) to stop the run first.
        assert len(job.events("fresh_start")) >= CRASH_CAP + 1
        assert max(r["step"] for r in job.records()) == 2
        assert _budget(tmp_path)["restarts_without_progress"] == CRASH_CAP + 1
    finally:
        with contextlib.suppress(SlurmError):  # ended already, unless the test failed early
            cluster.client.cancel(job.job_id)


def _step_dir(job: Job, launch: int) -> Path:
    return job.workdir / "ckpt" / ".slurmft" / "steps" / f"{job.job_id}.{launch}"


def _store_server_pid(port: int) -> int:
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"slurmft.agent.store" in cmdline and str(port).encode() in cmdline:
            return int(proc.name)
    raise AssertionError(f"no store server on port {port}")


@pytest.fixture
def free_port() -> int:
    from agent_cluster import free_port as pick

    return pick()


# A real time limit, measured on this 22.05 cluster: slurmctld checks time limits in a pass every
# ~30 s and sends `--signal=B:USR1@T` at the first pass where less than T + 30 s is left (seen:
# --time=1 with @30, @50 and --time=2 with @90 all signalled 26 s into the job, --time=2 with @60
# at 55 s, --time=2 with @50 at 55.7 s and 68.6 s), and ends a job at the first pass after its
# limit (--time=1: 65 s). So with --time=2 and a 30 s lead the batch shell gets USR1 60-90 s into
# the job, 30-60 s before its end: after the agents' start (up to ~45 s under load here).
TIME_LIMIT_MIN, SAVE_LEAD_S = 2, 30
# More than a first attempt trains before its USR1 (600 steps of >= 150 ms): the run must be
# requeued to finish.
LONG_STEPS = 600
LONG_ARGS = [*TINY_ARGS, "--steps", str(LONG_STEPS)]


@pytest.fixture
def alice_dir(test_users: TestUsers) -> Iterator[Path]:
    """A directory of slurmft-alice's that she reaches (pytest's tmp_path is private to root)."""
    path = test_users.alice.own(Path(tempfile.mkdtemp(prefix="slurmft-batch-")))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.users
def test_time_limit_signal_saves_requeues_and_resumes(
    cluster: Cluster, alice_dir: Path, free_port: int, test_users: TestUsers
) -> None:
    """Slurm itself sends USR1 to the batch shell before the time limit (the `--signal` that
    submit_request sets with a time limit): the ranks save, the batch step requeues its own job
    (as its owner, an unprivileged user), and the next attempt resumes from that save with
    identical losses and its restart budget untouched. (`scancel --batch --signal=USR1 JOB`
    sends the same signal at once.)"""
    job = submit(
        cluster,
        alice_dir,
        free_port,
        LONG_ARGS,
        time_limit=str(TIME_LIMIT_MIN),
        save_lead_s=SAVE_LEAD_S,
        as_user=test_users.alice,
    )
    try:
        assert cluster.client.job(job.job_id).raw["UserId"].startswith(test_users.alice.name)
        wait_for(job.records, 150, lambda: f"training under Slurm\n{job.output()[-3000:]}")
        started = _start_time(cluster, job)
        wait_for(
            lambda: cluster.client.job(job.job_id).restarts >= 1,
            TIME_LIMIT_MIN * 60 + 90,
            lambda: f"the requeue after Slurm's USR1\n{job.output()[-3000:]}",
        )
        # The next attempt gets the time for the rest: one time limit is what this test is about.
        _set_time_limit(cluster, job, minutes=15)
        assert _budget(alice_dir)["history"] == ["time limit: saved and requeued"]
        # The save on USR1 (the requested one, or an interval save that came first) is the
        # newest checkpoint at the requeue. The example journals "saved" after the commit, and
        # the batch step stops the ranks once it sees the commit: the journal can end a save
        # short of it (seen: resumed at 335, the journal's last save 334).
        at_requeue = checkpoint_step(newest_checkpoint(str(job.workdir / "ckpt")))
        journaled = max(job.events("saved"), key=lambda e: e["step"])
        assert journaled["time"] - started < TIME_LIMIT_MIN * 60  # before Slurm's limit
        assert at_requeue is not None and at_requeue >= journaled["step"]
        wait_for(lambda: job.events("done"), 420, lambda: f"the end\n{job.output()[-3000:]}")
        (resumed,) = job.events("resumed")
        assert resumed["step"] == at_requeue < LONG_STEPS
        budget = _budget(alice_dir)
        assert budget["restarts_without_progress"] == 0  # a time limit is not a crash
        assert budget["requeues"] == 1
        assert_replays_match(job, steps=LONG_STEPS)
    finally:
        cluster.client.cancel(job.job_id)


def _budget(workdir: Path) -> dict[str, Any]:
    return json.loads((workdir / "ckpt" / "slurmft-batch-state.json").read_text())


def _set_time_limit(cluster: Cluster, job: Job, minutes: int) -> None:
    subprocess.run(
        ["scontrol", "update", f"JobId={job.job_id}", f"TimeLimit={minutes}"],
        env={**os.environ, "SLURM_CONF": cluster.conf},
        timeout=30,
        check=True,
    )


def _start_time(cluster: Cluster, job: Job) -> float:
    """When the job's current attempt started (Slurm's StartTime, local time, whole seconds)."""
    raw = cluster.client.job(job.job_id).raw["StartTime"]
    return datetime.datetime.fromisoformat(raw).timestamp()
