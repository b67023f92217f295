"""Parsers on output recorded from the real commands (22.05.8, tests/fixtures/slurm/record.py)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from support.slurm_recordings import ReplayRunner, job_id_of

from slurmft.slurm import CliSlurmClient, commands
from slurmft.slurm.api import SlurmBadRequest, SlurmError
from slurmft.slurm.parse import (
    job_from_scontrol,
    node_from_scontrol,
    parse_sbatch_parsable,
    parse_scontrol_line,
    parse_scontrol_records,
    parse_sinfo_nodes,
    parse_squeue,
    parse_squeue_steps,
)
from slurmft.slurm.runner import CommandResult
from slurmft.slurm.script import (
    action_id_from_comment,
    comment_for_run,
    not_the_runs_job,
    run_id_from_comment,
)
from slurmft.slurm.states import JobState, NodeBase, NodeFlag
from slurmft.slurm.version import SlurmVersion, parse_version

Recorded = Callable[[str], CommandResult]
# What tests/fixtures/slurm/record.py drains n6 with.
HOSTILE_REASON = 'it\'s "bad" $(touch /tmp/x); a|b rm -rf / Foo=bar `id`'


def test_sbatch_parsable(recorded: Recorded) -> None:
    assert parse_sbatch_parsable(recorded("sbatch_parsable").stdout).isdigit()
    assert parse_sbatch_parsable("12;cluster2\n") == "12"
    with pytest.raises(SlurmError):
        parse_sbatch_parsable("")


def test_version(recorded: Recorded) -> None:
    version = parse_version(recorded("sinfo_version").stdout)
    assert version == SlurmVersion(22, 5, 8)
    assert not version.json_honours_filters
    assert parse_version("slurm 23.11.4").json_takes_data_parser
    assert parse_version("slurm 24.05.0-0rc1") == SlurmVersion(24, 5, 0)


def test_squeue_many_jobs_in_one_call(recorded: Recorded) -> None:
    result = recorded("squeue_many")
    jobs = parse_squeue(result.stdout)
    by_name = {job.name: job for job in jobs.values()}
    assert set(by_name) == {"slurmft-fixture", "held", "done"}
    running = by_name["slurmft-fixture"]
    assert running.state is JobState.RUNNING
    assert running.nodes == ("n1", "n2", "n3")
    assert running.batch_host == "n1"
    assert run_id_from_comment(running.comment) == "run-0001"
    held = by_name["held"]
    assert (held.state, held.reason, held.nodes, held.batch_host) == (
        JobState.PENDING,
        "JobHeldUser",
        (),
        "",
    )
    assert by_name["done"].state is JobState.COMPLETED
    assert "999999" not in jobs


def test_squeue_steps_of_a_job_that_lost_a_node(recorded: Recorded) -> None:
    steps = parse_squeue_steps(recorded("squeue_steps_shrunk").stdout)
    (agent_step,) = (step for step in steps if step.endswith(".0"))
    (batch,) = (step for step in steps if step.endswith(".batch"))
    assert len(steps[agent_step]) == 3 and len(steps[batch]) == 1
    assert steps[batch][0] in steps[agent_step]
    assert parse_squeue_steps(recorded("squeue_steps_unknown").stdout) == {}
    with pytest.raises(SlurmError):
        parse_squeue_steps("n1,n2\n")  # not a step line


def test_squeue_after_cancel_and_requeue(recorded: Recorded) -> None:
    jobs = parse_squeue(recorded("squeue_cancelled").stdout).values()
    assert {job.name: job.state for job in jobs} == {
        "held": JobState.CANCELLED,
        "slurmft-fixture": JobState.RUNNING,  # requeued, and running again
    }
    (requeued,) = parse_squeue(recorded("squeue_requeued").stdout).values()
    assert requeued.state is JobState.COMPLETING  # right after `scontrol requeue`


def test_scontrol_show_job_running(recorded: Recorded) -> None:
    (record,) = parse_scontrol_records(recorded("show_job_running").stdout)
    job = job_from_scontrol(record)
    assert job.state is JobState.RUNNING
    assert job.nodes == ("n1", "n2", "n3") and job.batch_host == "n1"
    assert (job.restarts, job.requeue, job.excluded_nodes) == (0, True, ())
    assert job.comment == "slurmft-run:run-0001"
    assert job.user_id == 0  # UserId=root(0): the owner, checked before the daemon acts on it
    assert record["AllocNode:Sid"] and record["CPUs/Task"] == "1"  # keys with : and /
    assert record["Power"] == ""


def test_scontrol_show_job_pending_with_excluded_nodes(recorded: Recorded) -> None:
    job = job_from_scontrol(parse_scontrol_records(recorded("show_job_pending_excluded").stdout)[0])
    assert job.state is JobState.PENDING
    assert job.excluded_nodes == ("n5", "n6")
    assert job.nodes == () and job.batch_host == ""


def test_scontrol_show_job_after_requeue(recorded: Recorded) -> None:
    requeued = job_from_scontrol(parse_scontrol_records(recorded("show_job_requeued").stdout)[0])
    assert requeued.restarts == 1
    rerun = job_from_scontrol(parse_scontrol_records(recorded("show_job_rerun").stdout)[0])
    assert (rerun.state, rerun.restarts) == (JobState.RUNNING, 1)


def test_scontrol_show_job_with_dead_batch_host(recorded: Recorded) -> None:
    job = job_from_scontrol(parse_scontrol_records(recorded("show_job_batch_host_down").stdout)[0])
    # --no-kill: the job shrank off its dead batch host and still says RUNNING.
    assert job.state is JobState.RUNNING
    assert job.batch_host == "n1" and "n1" not in job.nodes


def test_sinfo_nodes_drained_and_draining(recorded: Recorded) -> None:
    nodes = parse_sinfo_nodes(recorded("sinfo_nodes_drained").stdout)
    assert len(nodes) == 6
    assert nodes["n6"].status.drained
    assert nodes["n6"].reason == HOSTILE_REASON  # kept verbatim, `|` and all
    assert nodes["n6"].reason_user == "root"
    assert nodes["n3"].status.draining and nodes["n3"].reason == "slurmft: fixture"
    assert nodes["n4"].status.schedulable and nodes["n4"].reason == ""


def test_sinfo_dead_node_before_and_after_down(recorded: Recorded) -> None:
    before = parse_sinfo_nodes(recorded("sinfo_nodes_not_responding").stdout)["n1"]
    assert before.status.lost and not before.status.down
    after = parse_sinfo_nodes(recorded("sinfo_nodes_down").stdout)["n1"]
    assert after.status.down and NodeFlag.NOT_RESPONDING in after.status.flags
    assert after.reason == "Not responding"


def test_scontrol_show_node(recorded: Recorded) -> None:
    drained = node_from_scontrol(parse_scontrol_records(recorded("show_node_drained").stdout)[0])
    assert drained.status.drained and drained.status.base is NodeBase.IDLE
    assert drained.reason == HOSTILE_REASON  # ` Foo=bar` inside did not start a new key
    assert drained.reason_user == "root" and drained.reason_time.startswith("20")
    down = node_from_scontrol(parse_scontrol_records(recorded("show_node_down").stdout)[0])
    assert down.status.down and down.status.lost and down.reason == "Not responding"
    draining = node_from_scontrol(parse_scontrol_records(recorded("show_node_draining").stdout)[0])
    assert draining.status.draining and draining.status.base is NodeBase.MIXED
    allocated_record = parse_scontrol_records(recorded("show_node_allocated").stdout)[0]
    allocated = node_from_scontrol(allocated_record)
    assert not allocated.status.lost and allocated.reason == ""


def test_scontrol_line_first_key_wins() -> None:
    """A step's or node's record: a key repeated inside later free text does not override it."""
    record = parse_scontrol_line("StepId=1.0 State=RUNNING Name=a State=FAILED")
    assert record["State"] == "RUNNING"
    assert parse_scontrol_line("StepId=1.0 Name=my job NodeList=n1")["Name"] == "my job"


def test_a_job_line_is_read_by_slurms_key_order_only() -> None:
    with pytest.raises(SlurmError, match="no reading"):
        parse_scontrol_line("JobId=1 JobName=x JobState=RUNNING Comment=a JobState=FAILED")


def test_unexpected_squeue_line_is_an_error() -> None:
    with pytest.raises(SlurmError):
        parse_squeue("1|RUNNING\n")


def test_recordings_are_json_of_real_commands(recorded: Recorded) -> None:
    result = recorded("squeue_json")
    document = json.loads(result.stdout)
    assert document["meta"]["Slurm"]["release"] == "22.05.8"


def test_requeued_with_a_node_excluded(recorded: Recorded) -> None:
    held = job_from_scontrol(parse_scontrol_records(recorded("show_job_requeue_held").stdout)[0])
    assert held.reason == "job_requeued_in_held_state"
    rerun = job_from_scontrol(parse_scontrol_records(recorded("show_job_rerun_excluded").stdout)[0])
    assert rerun.state is JobState.RUNNING and rerun.restarts == 2
    assert rerun.excluded_nodes == ("n2",) and "n2" not in rerun.nodes
    assert len(rerun.nodes) == 3


def test_a_job_is_the_runs_only_with_its_owner_and_its_comment(recorded: Recorded) -> None:
    """What the daemon checks before it cancels, requeues or adopts a job for a run."""
    job = job_from_scontrol(parse_scontrol_records(recorded("show_job_running").stdout)[0])
    assert job.job_id == job_id_of(recorded("show_job_running"))
    assert not_the_runs_job(job, "run-0001", owner_uid=0) is None
    assert not_the_runs_job(job, "run-0001", owner_uid=1001) == (
        f"job {job.job_id} belongs to uid 0, the run to uid 1001"
    )
    assert not_the_runs_job(job, "run-0002", owner_uid=0) == (
        f"job {job.job_id} is tagged with run run-0001, not run run-0002"
    )
    untagged = job_from_scontrol(
        {**parse_scontrol_line(recorded("show_job_running").stdout), "Comment": "(null)"}
    )
    assert "tagged with no run" in (not_the_runs_job(untagged, "run-0001", owner_uid=0) or "")
    unknown_owner = job_from_scontrol(
        {**parse_scontrol_line(recorded("show_job_running").stdout), "UserId": "?"}
    )
    assert not_the_runs_job(unknown_owner, "run-0001", owner_uid=0) == (
        f"Slurm did not say who owns job {job.job_id}"
    )


def test_one_users_jobs_name_the_action_that_submitted_them(
    replay: Callable[..., tuple[CliSlurmClient, ReplayRunner]],
) -> None:
    """How a restarted daemon finds the job an interrupted resubmission submitted."""
    client, runner = replay("squeue_user")
    jobs = client.jobs_of_user(0)
    assert runner.exhausted
    assert all(job_id == job.job_id for job_id, job in jobs.items())
    # The user's other jobs are there too: a held one, and the running one of a full recording.
    by_run = {run_id_from_comment(job.comment): job for job in jobs.values()}
    tagged, plain = by_run["rec-resubmitted"], by_run["rec-held"]
    assert tagged.comment == comment_for_run("rec-resubmitted", 7)
    assert run_id_from_comment(tagged.comment) == "rec-resubmitted"
    assert action_id_from_comment(tagged.comment) == 7
    assert (run_id_from_comment(plain.comment), action_id_from_comment(plain.comment)) == (
        "rec-held",
        None,
    )


@pytest.mark.parametrize(
    "comment",
    [
        "slurmft-run:r1 slurmft-action:",
        "slurmft-run:r1 slurmft-action:7x",
        "slurmft-run:r1 slurmft-action:-7",
        "slurmft-run:r1 slurmft-action:" + "9" * 19,
        "slurmft-run:r1 slurmft-action:٣",  # a digit, not an ASCII one
        "slurmft-run:r1  slurmft-action:7",
        "someone's slurmft-action:7",
    ],
)
def test_an_action_tag_is_read_only_when_it_is_exactly_one(comment: str) -> None:
    assert action_id_from_comment(comment) is None


def test_a_users_jobs_are_asked_for_by_a_valid_uid() -> None:
    for uid in (-1, 2**32, True, "0"):
        with pytest.raises(SlurmBadRequest):
            commands.squeue_user_argv(uid)  # type: ignore[arg-type]
