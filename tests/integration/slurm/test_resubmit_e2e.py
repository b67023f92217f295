"""A job Slurm will not requeue is submitted again as the run's owner, on the real local cluster.

The test cluster preempts like many sites: a job in the higher-tier `urgent` partition cancels
the jobs in its way (``PreemptMode=CANCEL``), which end PREEMPTED, ``--requeue`` ignored
(measured on 22.05: PREEMPTED within about a second, Restarts=0). The daemon must record that as
expected (not charged to the crash budget), submit the job `slurmft submit` sent again as its
owner, and the run must resume from its checkpoint and complete.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import TINY, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.models import ActionKind, ActionStatus, Event, EventKind
from slurmft.db.states import AttemptState, RunState
from slurmft.slurm.parse import parse_scontrol_records

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]


def test_a_job_cancelled_by_preemption_is_resubmitted_as_its_owner_and_resumes(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    script = [*EXAMPLE, *TINY, "--steps", "30"]  # the last --steps counts
    run = submit(cluster, daemon, tmp_path, script, name="preempted", spares=0)
    run.wait_training(past_step=10)
    victim = sorted(set(run.beating_nodes().values()))[0]
    cluster.preempt(victim)

    attempts, _ = wait_for_value(
        "the daemon to submit the run's job again",
        run.attempts,
        lambda rows: len(rows) == 2 and rows[1].slurm_job_id != run.job_id,
        timeout_s=60,
    )
    first, second = attempts
    cluster._jobs.append(second.slurm_job_id)  # cancelled by the fixture whatever happens
    assert first.state is AttemptState.PREEMPTED
    assert _job_user(second.slurm_job_id) == pwd.getpwuid(os.geteuid()).pw_name

    wait_for_value(
        "the run to complete",
        lambda: run.run().state,
        lambda state: state is RunState.COMPLETED,
        timeout_s=240,
    )
    steps = sorted({r["step"] for r in run.jsonl("losses.jsonl")})
    assert steps == list(range(1, 31)), run.job_log()[-2000:]
    resumed = [e for e in run.jsonl("events.jsonl") if e.get("event") == "resumed"]
    assert resumed and resumed[-1]["step"] >= 10  # from its checkpoint, not from the start
    assert run.count_events(Event.kind == EventKind.PREEMPTED) == 1
    resubmits = [a for a in run.actions() if a.kind is ActionKind.RESUBMIT]
    assert [a.status for a in resubmits] == [ActionStatus.DONE]
    assert run.run().restarts_without_progress == 0  # an expected end, not charged
    run.database.dispose()


def _job_user(job_id: str) -> str:
    """The job's owner as slurmctld records it: UserId=name(uid)."""
    argv = ["scontrol", "--oneliner", "show", "job", job_id]
    shown = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    (record,) = parse_scontrol_records(shown)
    return record["UserId"].split("(")[0]
