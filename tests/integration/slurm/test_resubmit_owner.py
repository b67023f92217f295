"""Who a resubmitted job belongs to, on the real local Slurm cluster.

A root daemon submits the recorded job as the run's owner (uid, gid and groups switched in the
child), so Slurm records the owner and the job runs with the owner's rights; a daemon that is
neither root nor the owner submits nothing and says it waits for the owner.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from local_cluster import Cluster
from support.waiting import wait_for_value
from unix_users import TestUsers

from slurmft.controller.resubmit import (
    WAITING_FOR_OWNER,
    OwnerSubmitter,
    SubmissionError,
    submission_record,
)
from slurmft.db.models import Run
from slurmft.slurm.api import SubmitRequest
from slurmft.slurm.parse import parse_scontrol_records

pytestmark = [pytest.mark.slurm, pytest.mark.users]


def _run_of(owner_uid: int, owner_name: str, request: SubmitRequest, workdir: Path) -> Run:
    record = submission_record(request, workdir=str(workdir), path="/usr/bin:/bin")
    return Run(
        id="rowner",
        name="owner",
        owner_uid=owner_uid,
        owner_name=owner_name,
        nodes=1,
        command=["train.py"],
        submission=record,
    )


def _job_record(job_id: str) -> dict[str, str]:
    argv = ["scontrol", "--oneliner", "show", "job", job_id]
    (record,) = parse_scontrol_records(
        subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    )
    return record


def test_a_root_daemon_submits_the_recorded_job_as_the_runs_owner(
    cluster: Cluster, test_users: TestUsers, open_dir: Path
) -> None:
    alice = test_users.alice
    workdir = alice.own(open_dir / "alice")
    request = SubmitRequest(
        script=f'#!/bin/bash\nid -un > {workdir}/who\necho "$HOME" >> {workdir}/who\n',
        job_name="slurmft-owner",
        run_id="rowner",
        nodes=1,
        output=str(workdir / "slurm-%j.out"),
    )
    submitter = OwnerSubmitter(
        slurm_conf=os.environ["SLURM_CONF"], timeout_s=20, daemon_uid=os.geteuid()
    )
    run = _run_of(alice.uid, alice.name, request, workdir)
    job_id = submitter(run, frozenset({"n6"}), 41)
    cluster._jobs.append(job_id)

    record = _job_record(job_id)
    assert record["UserId"] == f"{alice.name}({alice.uid})"
    # Tagged with the action that submitted it: a restarted daemon finds it by that.
    assert record["Comment"] == "slurmft-run:rowner slurmft-action:41"
    assert record["ExcNodeList"] == "n6"  # today's exclusions, not the recorded ones
    assert record["WorkDir"] == str(workdir)
    who, _ = wait_for_value(
        "the job to write who it ran as",
        lambda: (workdir / "who").read_text() if (workdir / "who").exists() else "",
        lambda text: text.count("\n") == 2,
        timeout_s=60,
    )
    assert who.split() == [alice.name, str(alice.home)]


def test_a_daemon_that_is_neither_root_nor_the_owner_waits_for_the_owner(
    test_users: TestUsers, tmp_path: Path
) -> None:
    alice, bob = test_users.alice, test_users.bob
    request = SubmitRequest(script="#!/bin/bash\ntrue\n", job_name="x", run_id="rowner", nodes=1)
    submitter = OwnerSubmitter(slurm_conf=None, timeout_s=20, daemon_uid=bob.uid)
    with pytest.raises(SubmissionError, match=WAITING_FOR_OWNER):
        submitter(_run_of(alice.uid, alice.name, request, tmp_path), frozenset(), 1)
