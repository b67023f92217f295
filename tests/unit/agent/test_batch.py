"""The batch step's plan: job script (golden), agent step srun line, budget and next move."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from slurmft.agent.batch import (
    BatchSpec,
    BatchState,
    Move,
    StepOutcomes,
    after_step,
    job_script,
    newest_checkpoint,
    srun_argv,
    submit_request,
    usable_nodes,
    write_step_outcome,
)
from slurmft.agent.batch_step import BatchStep
from slurmft.api import submission
from slurmft.config import load_config
from slurmft.controller.spec import RunSpec
from slurmft.core.budget import RestartBudget
from slurmft.core.exits import BatchExit
from slurmft.core.kinds import NodeRole
from slurmft.protocol import AgentBatch, AllocationMember, AllocationReport
from slurmft.slurm.api import JobInfo, NodeInfo, SignalTarget, SubmitRequest
from slurmft.slurm.commands import submit_argv
from slurmft.slurm.states import JobState, parse_node_state

GOLDEN = Path(__file__).parent / "golden" / "batch_script.sh"
SPEC = BatchSpec(
    run_id="r0a1b2c3",
    nodes=3,
    spares=1,
    script=("-m", "pkg.train", "--lr", "0.1", "--name", "it's $(rm -rf ~)"),
    ckpt_dir="/shared/ckpt/r0a1b2c3",
    slurmft="/opt/slurmft/bin/slurmft",
    token_file="/home/u/.slurmft/r0a1b2c3.token",
)


def test_job_script_matches_the_golden_file() -> None:
    text = job_script(SPEC)
    if os.environ.get("SLURMFT_TEST_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_sbatch_line_asks_for_n_plus_s_no_kill_requeue_and_usr1_before_the_limit() -> None:
    argv = submit_argv(
        submit_request(SPEC, job_name="slurmft-demo", time_limit="2:00:00", save_lead_s=300)
    )
    assert "--nodes=4" in argv and "--no-kill" in argv and "--requeue" in argv
    assert "--signal=B:USR1@300" in argv and "--time=2:00:00" in argv


def test_agent_step_srun_line() -> None:
    argv = srun_argv(["n1", "n2", "n3", "n5"], SPEC.agent_argv("10.0.0.1"))
    assert argv == [
        "srun",
        "--no-kill",
        "--kill-on-bad-exit=0",
        "--overlap",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--nodelist=n[1-3,5]",
        "--immediate=60",
        "/opt/slurmft/bin/slurmft",
        "agent",
        "run",
        "--nodes=3",
        "--nproc-per-node=1",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--run-id=r0a1b2c3",
        "--token-file=/home/u/.slurmft/r0a1b2c3.token",
        "--",
        "-m",
        "pkg.train",
        "--lr",
        "0.1",
        "--name",
        "it's $(rm -rf ~)",
    ]


def test_every_agent_step_asks_for_the_gpus_and_cpus_of_its_node() -> None:
    """GRES are not given to a step unasked (not even under --exclusive): each step names
    them, and the batch script hands them to the batch step, which starts every step."""
    gpu_spec = replace(SPEC, nproc_per_node="gpu", step_gres="gpu:8", cpus_per_task=96)
    argv = srun_argv(["n1", "n2"], gpu_spec.agent_argv("10.0.0.1"), gpu_spec.step_options())
    assert argv[9:11] == ["--gres=gpu:8", "--cpus-per-task=96"]
    assert "--nproc-per-node=gpu" in argv
    batch = gpu_spec.batch_argv()
    assert {"--step-gres=gpu:8", "--cpus-per-task=96", "--nproc-per-node=gpu"} <= set(batch)
    sbatch = submit_argv(
        submit_request(
            gpu_spec, job_name="slurmft-demo", site={"gpus_per_node": 8, "exclusive": True}
        )
    )
    assert {"--gpus-per-node=8", "--exclusive", "--cpus-per-task=96"} <= set(sbatch)


def node(name: str, state: str) -> NodeInfo:
    return NodeInfo(name, parse_node_state(state))


def test_usable_nodes_leave_out_lost_draining_and_cordoned() -> None:
    info = {
        n.name: n
        for n in [
            node("n1", "ALLOCATED"),
            node("n2", "DOWN*"),
            node("n3", "MIXED+DRAIN"),
            node("n4", "ALLOCATED*"),
            node("n5", "ALLOCATED"),
            node("n6", "ALLOCATED"),
        ]
    }
    nodes = ["n1", "n2", "n3", "n4", "n5", "n6", "n7"]
    assert usable_nodes(nodes, info, cordoned=["n6"]) == ["n1", "n5"]


@pytest.mark.parametrize(
    ("returncode", "usable", "checkpoint", "no_progress_before", "move", "no_progress_after"),
    [
        (0, ["n1"], "", 4, Move.FINISH, 4),
        # Progress since the last launch: a fresh budget, this restart the first of it.
        (1, ["n1", "n2", "n3"], "step-000000010", 4, Move.RELAUNCH, 1),
        (1, ["n1", "n2", "n3"], "step-000000005", 3, Move.RELAUNCH, 4),
        (1, ["n1", "n2", "n3"], "step-000000005", 4, Move.RELAUNCH, 5),  # the fifth restart
        (1, ["n1", "n2", "n3"], "step-000000005", 5, Move.GIVE_UP, 6),  # then the cap
        (1, ["n1", "n2"], "step-000000010", 0, Move.REQUEUE, 1),
    ],
)
def test_after_step(  # noqa: PLR0917 (one parameter per table column)
    returncode: int,
    usable: list[str],
    checkpoint: str,
    no_progress_before: int,
    move: Move,
    no_progress_after: int,
) -> None:
    before = RestartBudget(
        restarts_without_progress=no_progress_before, last_progress="step-000000005"
    )
    decision = after_step(returncode, usable, SPEC, before, checkpoint)
    assert decision.move is move, decision.reason
    assert decision.budget.restarts_without_progress == no_progress_after
    assert before.restarts_without_progress == no_progress_before  # a new budget, not changed
    if move is Move.RELAUNCH:
        assert decision.nodes == tuple(usable)


def test_budget_survives_a_requeue_in_the_checkpoint_directory(tmp_path: Path) -> None:
    assert BatchState.load(str(tmp_path), 5) == BatchState(RestartBudget(5))
    state = BatchState(
        RestartBudget(5, restarts_without_progress=2, last_progress="step 15"),
        step_launches=3,
        requeues=1,
        history=("a",),
    )
    state.save(str(tmp_path))
    assert BatchState.load(str(tmp_path), 5) == state
    # The job's own cap wins over the recorded one.
    assert BatchState.load(str(tmp_path), 7).budget.max_restarts_without_progress == 7
    (tmp_path / "step-000000015").mkdir()
    (tmp_path / "step-000000020").mkdir()
    (tmp_path / ".staging-step-000000025").mkdir()
    assert newest_checkpoint(str(tmp_path)) == "step-000000020"


def test_a_state_file_of_the_previous_version_reads_as_the_same_budget(tmp_path: Path) -> None:
    """A job requeued across an upgrade: its batch step reads the file slurmft 0.1's batch
    step wrote (made by that version's code: the count, the progress as `last_checkpoint`, no
    cap) and goes on counting."""
    (tmp_path / "slurmft-batch-state.json").write_text(
        (Path(__file__).parent / "golden" / "batch_state_v0.1.json").read_text()
    )
    state = BatchState.load(str(tmp_path), 5)
    assert state.budget == RestartBudget(5, restarts_without_progress=4, last_progress="step 40")
    assert (state.step_launches, state.requeues) == (4, 1)
    assert state.history[-1] == "agent step ended with 1: relaunch on 3 nodes"
    # Charged on from there: one more restart without progress, then the cap stops it.
    budget = state.budget
    for move in (Move.RELAUNCH, Move.GIVE_UP):
        decision = after_step(1, ["n1", "n2", "n3"], SPEC, budget, "step 40")
        assert decision.move is move, decision.reason
        budget = decision.budget
    assert budget.restarts_without_progress == 6
    # Progress under the old name's label resets it.
    assert after_step(1, ["n1", "n2", "n3"], SPEC, state.budget, "step 41").budget == (
        RestartBudget(
            5,
            restarts_without_progress=1,
            last_progress="step 41",
            restarts_by_class={"unknown": 1},
        )
    )
    state.save(str(tmp_path))
    assert BatchState.load(str(tmp_path), 5) == state
    (tmp_path / "step-000000015").mkdir()
    (tmp_path / "step-000000020").mkdir()
    (tmp_path / ".staging-step-000000025").mkdir()
    assert newest_checkpoint(str(tmp_path)) == "step-000000020"


def test_the_batch_step_and_the_daemon_share_one_budget() -> None:
    """A script that always crashes: both stop it after the same number of restarts."""
    from slurmft.core.budget import Restart
    from slurmft.core.kinds import FaultClass

    state, launches = RestartBudget(SPEC.max_restarts_without_progress), 0
    while (decision := after_step(1, ["n1", "n2", "n3"], SPEC, state, "")).move is Move.RELAUNCH:
        launches += 1
        state = decision.budget
    budget, restarts = (
        RestartBudget(max_restarts_without_progress=SPEC.max_restarts_without_progress),
        0,
    )
    while not (budget := budget.charge(Restart(FaultClass.USER_CODE))).exhausted:
        restarts += 1
    assert launches == restarts == SPEC.max_restarts_without_progress


def test_a_step_whose_agents_finished_is_finished_though_one_left(tmp_path: Path) -> None:
    """srun's exit is the highest of its tasks': the agent told to leave exited 4 while the
    others finished training. The outcomes say so; the budget is not touched."""
    step = str(tmp_path / "steps" / "7.1")
    for node in ("n1", "n3", "n4"):
        write_step_outcome(step, node, "FINISHED")
    write_step_outcome(step, "n2", "LEFT_CORDONED", "leave: slurmft: straggler rank 1")
    (Path(step) / "n9.json").write_text("{torn")  # ignored, not fatal
    outcomes = StepOutcomes.read(step)
    assert outcomes.cordoned == {"n2"} and outcomes.finished
    state = RestartBudget(restarts_without_progress=2)
    decision = after_step(4, ["n1", "n3", "n4"], SPEC, state, "step-000000005", outcomes)
    assert decision.move is Move.FINISH
    assert decision.reason == "training finished (agent step exit 4: n2 left_cordoned)"
    assert decision.budget == state


def test_a_stopped_or_failed_agent_cordons_nothing_and_finishes_nothing(tmp_path: Path) -> None:
    step = str(tmp_path / "7.2")
    write_step_outcome(step, "n1", "LEFT")  # stopped by a signal: the batch step's own stop
    write_step_outcome(step, "n2", "FAILED")
    write_step_outcome(step, "n3", "PREFLIGHT_FAILED")  # unfit: kept out of this job
    outcomes = StepOutcomes.read(step)
    assert outcomes.cordoned == {"n3"} and not outcomes.finished
    assert StepOutcomes.read(str(tmp_path / "absent")).by_node == {}
    decision = after_step(1, ["n1", "n2", "n4"], SPEC, RestartBudget(), "", outcomes)
    assert decision.move is Move.RELAUNCH and decision.nodes == ("n1", "n2", "n4")


class SignalRecorder:
    """The one SlurmClient call `BatchStep._stop` makes."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, SignalTarget]] = []

    def signal(self, job_id: str, signal: str, target: SignalTarget) -> None:
        self.sent.append((signal, target))


@pytest.mark.parametrize(
    ("srun", "sent"),
    [
        (["true"], [("TERM", SignalTarget.STEPS)]),
        # srun outlives the grace period: it is killed, and so is every agent of its step, since
        # the next step shares their CPUs (srun --overlap) and must not start beside them.
        (["sleep", "60"], [("TERM", SignalTarget.STEPS), ("KILL", SignalTarget.STEPS)]),
    ],
)
def test_a_stopped_agent_step_leaves_no_agent_behind(
    tmp_path: Path, srun: list[str], sent: list[tuple[str, SignalTarget]]
) -> None:
    client = SignalRecorder()
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path))
    batch = BatchStep(spec, client, "7", "127.0.0.1", stop_grace_s=0.5)  # type: ignore[arg-type]
    step = subprocess.Popen(srun)
    try:
        batch._stop(step)
    finally:
        step.kill()
        step.wait()
    assert client.sent == sent


class AllocationSlurm:
    """What the batch step asks Slurm for its nodes: job 7 holds n1-n4; after the first step
    n2 is down (a --no-kill job keeps it listed until Slurm takes it away)."""

    def __init__(self) -> None:
        self.down: set[str] = set()

    def job(self, job_id: str) -> JobInfo:
        return JobInfo(job_id, JobState.RUNNING, nodes=("n1", "n2", "n3", "n4"))

    def nodes(self, names: Sequence[str] = ()) -> dict[str, NodeInfo]:
        return {
            n: NodeInfo(n, parse_node_state("down*" if n in self.down else "allocated"))
            for n in names
        }


def test_the_batch_step_reports_its_allocation_at_start_and_after_a_relaunch_elsewhere(
    tmp_path: Path,
) -> None:
    slurm = AllocationSlurm()
    reports: list[AllocationReport] = []
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path))
    batch = BatchStep(spec, slurm, "7", "127.0.0.1", report_allocation=reports.append)  # type: ignore[arg-type]
    steps: list[tuple[str, ...]] = []

    def run_step(nodes: Sequence[str]) -> int:
        steps.append(tuple(nodes))
        if len(steps) == 1:
            slurm.down.add("n2")
            return 1  # the step failed: relaunched on the usable nodes
        if len(steps) == 2:
            return 1  # the same nodes again: nothing new to report
        return 0

    batch._run_step = run_step  # type: ignore[method-assign]
    assert batch._loop() is BatchExit.FINISHED
    assert steps == [("n1", "n2", "n3", "n4"), ("n1", "n3", "n4"), ("n1", "n3", "n4")]
    active, spare = NodeRole.ACTIVE, NodeRole.SPARE
    assert reports == [
        AllocationReport(
            "7",
            (
                AllocationMember("n1", active),
                AllocationMember("n2", active),
                AllocationMember("n3", active),
                AllocationMember("n4", spare),
            ),
        ),
        AllocationReport(
            "7",
            (
                AllocationMember("n1", active),
                AllocationMember("n3", active),
                AllocationMember("n4", active),
            ),
        ),
    ]
    # On the wire, in the batch step's batch (the daemon checks it against Slurm).
    batch_json = AgentBatch(
        run_id="r",
        agent_id="batch-step:7-x",
        node="n1",
        seq=1,
        sent_at=1.7e9,
        allocation=reports[0],
    ).to_json()
    assert AgentBatch.from_json(batch_json).allocation == reports[0]


class SilentNodeSlurm:
    """Job 7 holds n1-n4; n2's slurmd is silent (`mixed*`) for the first `silent_for` looks,
    then it is DOWN (`down*`); every requeue is recorded with the state n2 was in."""

    def __init__(self, silent_for: int) -> None:
        self.silent_for, self.looks = silent_for, 0
        self.requeued: list[str] = []

    def job(self, job_id: str) -> JobInfo:
        return JobInfo(job_id, JobState.RUNNING, nodes=("n1", "n2", "n3", "n4"))

    def _n2(self) -> str:
        return "mixed*" if self.looks <= self.silent_for else "down*"

    def nodes(self, names: Sequence[str] = ()) -> dict[str, NodeInfo]:
        self.looks += 1
        states = {n: self._n2() if n == "n2" else "mixed" for n in names}
        return {n: NodeInfo(n, parse_node_state(state)) for n, state in states.items()}

    def requeue(self, job_id: str, exclude: Sequence[str] = ()) -> None:
        self.requeued.append(self._n2())


@pytest.mark.parametrize(
    ("step_gres", "silent_for", "fence_wait_s", "expected"),
    [
        ("gpu:2", 2, 30.0, ("down*", 3)),  # waits for the DOWN (the daemon's, or Slurm's)
        ("gpu:2", 1000, 0.5, ("mixed*", None)),  # bounded: requeued anyway, and logged
        ("", 2, 30.0, ("mixed*", 0)),  # no GRES: no wait
    ],
)
def test_a_gpu_job_is_requeued_once_its_silent_nodes_are_down(
    tmp_path: Path,
    step_gres: str,
    silent_for: int,
    fence_wait_s: float,
    expected: tuple[str, int | None],
) -> None:
    """Slurm 22.05 breaks the GPUs of a job requeued while it holds a silent node that is not
    DOWN yet (docs/slurm.md); the batch step cannot set DOWN, so it waits, within a bound."""
    slurm = SilentNodeSlurm(silent_for)
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path), step_gres=step_gres)
    batch = BatchStep(spec, slurm, "7", "127.0.0.1", poll_s=0.05, fence_wait_s=fence_wait_s)  # type: ignore[arg-type]
    assert batch._requeue("2 usable nodes, 3 needed") is BatchExit.REQUEUE
    state, looks = expected
    assert slurm.requeued == [state]
    if looks is not None:
        assert slurm.looks == looks


class FlickeringSlurm:
    """Job 7 holds n1-n3, all in the agent step; n2 is in the state ``n2`` says."""

    def __init__(self) -> None:
        self.n2 = "mixed"

    def job(self, job_id: str) -> JobInfo:
        return JobInfo(job_id, JobState.RUNNING, nodes=("n1", "n2", "n3"))

    def nodes(self, names: Sequence[str] = ()) -> dict[str, NodeInfo]:
        return {n: NodeInfo(n, parse_node_state(self.n2 if n == "n2" else "mixed")) for n in names}


@pytest.mark.parametrize(
    ("confirm_s", "looks", "ends"),
    [
        (3600.0, ["mixed*", "mixed", "mixed*"], [False, False, False]),  # a flicker: kept
        (0.0, ["mixed*"], [True]),  # held confirm_s (here at once): the step ends
        (3600.0, ["mixed", "down*"], [False, True]),  # Slurm's DOWN needs no confirmation
        (3600.0, ["mixed", "idle"], [False, True]),  # taken out of the job: not in doubt
    ],
)
def test_the_agent_step_ends_for_a_silent_node_only_once_slurms_word_is_confirmed(
    tmp_path: Path, confirm_s: float, looks: list[str], ends: list[bool]
) -> None:
    """One poll of "not responding" must not cost a relaunch (docs/design.md, the confirmed
    Slurm fact): Slurm has been seen to call a node so for under a second."""
    slurm = FlickeringSlurm()
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path))
    batch = BatchStep(spec, slurm, "7", "127.0.0.1", confirm_s=confirm_s)  # type: ignore[arg-type]
    seen = []
    for state in looks:
        slurm.n2 = state
        if state == "idle":  # Slurm shrank the job
            slurm.job = lambda job_id: JobInfo(job_id, JobState.RUNNING, nodes=("n1", "n3"))  # type: ignore[method-assign]
        seen.append(batch._step_cannot_recover(("n1", "n2", "n3")))
    assert seen == ends


def test_an_agent_step_that_finished_on_one_agent_is_ended_after_a_grace(tmp_path: Path) -> None:
    """Training finished on n1; n4's torchrun waits for a round no peer will join (its worker
    aborted at exit): after the grace the batch step stops the step, which reads finished."""
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path))
    batch = BatchStep(spec, FlickeringSlurm(), "7", "127.0.0.1", finish_grace_s=0.2)  # type: ignore[arg-type]
    batch.outcome_dir = str(tmp_path / "outcomes")
    assert not batch._finished_elsewhere()  # no agent has ended yet
    write_step_outcome(batch.outcome_dir, "n1", "FINISHED")
    assert not batch._finished_elsewhere()  # the others get their grace
    time.sleep(0.25)
    assert batch._finished_elsewhere()


def _spec_run(**fields: object) -> RunSpec:
    return RunSpec(name="r", nodes=2, script=("train.py",), ckpt_dir="/shared/ck", spares=0,
                   python="/opt/venv/bin/python", **fields)  # type: ignore[arg-type]  # fmt: skip


def _planned(run: RunSpec) -> tuple[BatchSpec, SubmitRequest]:
    """What `slurmft submit` would send for ``run`` (nothing is run)."""
    created = {"run_id": "r1", "controller_url": "http://login:8787", "exclude": []}
    config = load_config(environ={}, system_file=Path("/nonexistent"))
    return submission.batch_plan(config, run, created, "/shared/ck/.slurmft/token")


def _agent_step(run: RunSpec) -> list[str]:
    """The agent step's srun argv as `slurmft submit` plans it."""
    batch, _ = _planned(run)
    # The batch step builds its BatchSpec again from the batch script's own argv.
    return srun_argv(["n1", "n2"], batch.agent_argv("10.0.0.1"), batch.step_options())


def test_a_pyxis_run_gives_every_agent_step_its_container_options() -> None:
    image = "nvcr.io#nvidia/pytorch:24.05-py3"
    run = _spec_run(container_image=image, container_mounts="/shared:/shared")
    argv = _agent_step(replace(run, python="python3"))
    options = argv[: argv.index("python3")]
    assert options[-2:] == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        "--container-mounts=/shared:/shared",
    ]
    assert argv[argv.index("python3") :][:4] == ["python3", "-m", "slurmft", "agent"]


def test_an_apptainer_run_is_a_wrapper_around_the_agent() -> None:
    argv = _agent_step(_spec_run(apptainer="/shared/images/train.sif"))
    wrapper = ["apptainer", "exec", "--nv", "--bind", "/shared/ck", "/shared/images/train.sif"]
    start = argv.index("apptainer")
    assert argv[start : start + 6] == wrapper
    assert argv[start + 6 : start + 10] == ["/opt/venv/bin/python", "-m", "slurmft", "agent"]


def test_setup_lines_run_before_the_agent_inside_the_wrapper_and_the_agent_replaces_the_shell(
    tmp_path: Path,
) -> None:
    run = _spec_run(container_wrapper="env SLURMFT_WRAPPED=1",
                    setup=("export FROM_SETUP=yes", "cd /"))  # fmt: skip
    argv = _agent_step(run)
    command = argv[argv.index("env") :]
    assert command[:6] == [
        "env",
        "SLURMFT_WRAPPED=1",
        "/bin/bash",
        "-c",
        command[4],
        "slurmft-setup",
    ]
    # Run the wrapper and the setup shell for real, with a stand-in for the agent.
    shown = tmp_path / "shown"
    stand_in = [
        *command[:6],
        "sh",
        "-c",
        f'echo "$FROM_SETUP $SLURMFT_WRAPPED $PWD $$" > {shown}; echo $$',
    ]
    done = subprocess.run(stand_in, capture_output=True, text=True, check=True)
    from_setup, wrapped, cwd, pid = shown.read_text().split()
    assert (from_setup, wrapped, cwd) == ("yes", "1", "/")
    assert pid == done.stdout.strip()  # exec "$@": the shell became the command


def test_the_batch_script_runs_the_setup_lines_before_the_batch_step() -> None:
    _, request = _planned(_spec_run(setup=("export FROM_SETUP=yes",), env={"FROM_ENV": "a b"}))
    lines = request.script.splitlines()
    assert lines.index("export FROM_SETUP=yes") < lines.index("set -u") < len(lines) - 1
    assert "export FROM_ENV='a b'" in lines
    assert lines[-1].startswith("exec /opt/venv/bin/python -m slurmft agent batch ")
    batch = shlex.split(lines[-1])
    assert "--setup=export FROM_SETUP=yes" in batch


def test_a_container_run_keeps_the_batch_step_outside_with_slurmfts_interpreter() -> None:
    _, request = _planned(replace(_spec_run(apptainer="/img.sif"), python="/usr/bin/python3"))
    last = shlex.split(request.script.splitlines()[-1])
    assert last[1:4] == [sys.executable, "-m", "slurmft"]
    assert "--agent-python=/usr/bin/python3" in last
    assert "--agent-wrapper=apptainer exec --nv --bind /shared/ck /img.sif" in last
