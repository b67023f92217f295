"""The batch step's allocation report against Slurm's record of its job: a table (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurmft.controller.allocation import Verdict, check_report
from slurmft.db.models import Attempt, NodeRole, Run
from slurmft.slurm.api import JobInfo
from slurmft.slurm.states import JobState

A, S = NodeRole.ACTIVE, NodeRole.SPARE
JOB = JobInfo("14", JobState.RUNNING, nodes=("n1", "n2", "n3"), comment="slurmft-run:rb", user_id=2)
CLAIM = {"n1": A, "n2": A, "n3": S}


@pytest.mark.parametrize(
    ("case", "job", "claim", "attempt_job", "verdict"),
    [
        ("checks out", JOB, CLAIM, "14", Verdict(members=CLAIM)),
        ("no job attached yet: adoptable", JOB, CLAIM, None, Verdict(members=CLAIM)),
        (
            "nodes Slurm does not give the job are left out",
            JOB,
            {"n1": A, "n9": A},
            "14",
            Verdict(members={"n1": A}, ignored=("n9",)),
        ),
        (
            "another user's job",
            replace(JOB, user_id=1),
            CLAIM,
            "14",
            Verdict(refused="job 14 belongs to uid 1, the run to uid 2"),
        ),
        (
            "a job of another run",
            replace(JOB, comment="slurmft-run:ra"),
            CLAIM,
            "14",
            Verdict(refused="job 14 is tagged with run ra, not run rb"),
        ),
        (
            "not the attempt's job",
            JOB,
            CLAIM,
            "15",
            Verdict(refused="job 14 is not the attempt's job 15"),
        ),
        (
            "requeued since: the next attempt's, judged once it is open",
            replace(JOB, restarts=1),
            CLAIM,
            "14",
            Verdict(wait=True),
        ),
        (
            "a job that holds no nodes",
            replace(JOB, state=JobState.PENDING, nodes=()),
            CLAIM,
            "14",
            Verdict(refused="job 14 holds no nodes (PENDING)"),
        ),
        (
            "none of the reported nodes",
            JOB,
            {"n7": A},
            "14",
            Verdict(refused="job 14 holds none of the reported nodes"),
        ),
    ],
)
def test_check_report(
    case: str,
    job: JobInfo,
    claim: dict[str, NodeRole],
    attempt_job: str | None,
    verdict: Verdict,
) -> None:
    run = Run(id="rb", owner_uid=2)
    attempt = Attempt(run_id="rb", number=1, slurm_job_id=attempt_job, slurm_restarts=0)
    assert check_report(job, claim, run, attempt) == verdict, case


def test_a_node_lost_before_the_report_was_judged_is_stored_when_its_step_names_it() -> None:
    """The daemon was down when the job started and n3 died since: Slurm's job record no longer
    names n3 (shrunk under --no-kill), the agent step's still does (squeue_steps_shrunk)."""
    run = Run(id="rb", owner_uid=2)
    attempt = Attempt(run_id="rb", number=1, slurm_job_id="14", slurm_restarts=0)
    shrunk = replace(JOB, nodes=("n1", "n2"))
    claim = {"n1": A, "n2": S, "n3": A, "n9": A}
    steps = frozenset({"n1", "n2", "n3"})
    assert check_report(shrunk, claim, run, attempt, steps) == Verdict(
        members={"n1": A, "n2": S, "n3": A}, ignored=("n9",)
    )
    # Without the step's word, the lost node is only the poster's claim: left out.
    assert check_report(shrunk, claim, run, attempt) == Verdict(
        members={"n1": A, "n2": S}, ignored=("n3", "n9")
    )
