"""A daemon killed between sbatch and its commit submits no second job (issue 14, item 8), on
the real local cluster with the real daemon.

A test-only `sbatch` first on the daemon's PATH submits through the real one, then SIGKILLs the
daemon (its parent) before it answers: the job exists, the daemon never heard of it. The
restarted daemon must find that job by the action's tag in its comment and adopt it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, running_daemon
from local_cluster import Cluster
from sqlalchemy import select
from support.waiting import wait_for_value

from slurmft.controller.resubmit import submission_record
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Attempt, Run
from slurmft.db.states import RunState
from slurmft.slurm.api import SubmitRequest
from slurmft.slurm.script import render_batch_script, run_id_from_comment

pytestmark = [pytest.mark.slurm]

RUN_ID = "intent-e2e"
# Submits once through the real sbatch, writes the job id down, and kills its caller; once the
# job id is written it is the real sbatch, so a daemon that submits again really submits.
KILLING_SBATCH = """#!/bin/bash
if [[ -e {marker} ]]; then exec /usr/bin/sbatch "$@"; fi
out=$(/usr/bin/sbatch "$@") || exit $?
echo "${{out%%;*}}" > {marker}
kill -KILL $PPID
sleep 30
"""


def _killing_sbatch(directory: Path, marker: Path) -> Path:
    directory.mkdir()
    wrapper = directory / "sbatch"
    wrapper.write_text(KILLING_SBATCH.format(marker=marker))
    wrapper.chmod(0o755)
    return directory


def _seed_preemptable_run(database: Database, cluster: Cluster, tmp_path: Path, path: str) -> str:
    """A run of root's whose one job runs now; its recorded submission is a plain sleep."""
    script = render_batch_script(["sleep", "600"])
    request = SubmitRequest(
        script=script,
        job_name="slurmft-intent",
        run_id=RUN_ID,
        nodes=1,
        output=str(tmp_path / "job-%j.out"),
    )
    job_id = cluster.submit(["sleep", "600"], nodes=1, run_id=RUN_ID, job_name="slurmft-intent")
    with database.session() as s:
        run = Run(
            id=RUN_ID,
            name="intent",
            owner_uid=os.geteuid(),
            owner_name="root",
            nodes=1,
            spares=0,
            command=["sleep", "600"],
            submission=submission_record(request, workdir=str(tmp_path), path=path),
        )
        s.add(run)
        s.flush()
        run.state = RunState.RUNNING
        s.add(Attempt(run_id=RUN_ID, number=1, slurm_job_id=job_id))
    return job_id


def _resubmissions(database: Database) -> list[tuple[ActionStatus, object]]:
    with database.session() as s:
        rows = s.scalars(select(Action).where(Action.kind == ActionKind.RESUBMIT)).all()
        return [(a.status, a.evidence.get("slurm_job_id")) for a in rows]


def test_a_daemon_killed_between_sbatch_and_its_commit_adopts_the_job_after_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    marker = tmp_path / "submitted-job"
    wrappers = _killing_sbatch(tmp_path / "bin", marker)
    path = f"{wrappers}:{os.environ['PATH']}"
    with running_daemon(tmp_path, PATH=path) as daemon:
        state_dir = Path(daemon.env["SLURMFT_PATHS_STATE_DIR"])
        database = Database(f"sqlite:///{state_dir / 'slurmft.db'}")
        first = _seed_preemptable_run(database, cluster, tmp_path, path)
        job, _ = cluster.wait_running(first)
        cluster.preempt(job.nodes[0])  # PREEMPTED: the daemon submits the run's job again

        assert daemon.proc is not None
        exit_code = daemon.proc.wait(timeout=90)
        assert exit_code == -signal.SIGKILL, daemon.log.read_text()[-2000:]
        submitted = marker.read_text().strip()
        cluster._jobs.append(submitted)  # cancelled by the fixture whatever happens
        # Killed after sbatch: the intent is recorded, the outcome is not.
        assert _resubmissions(database) == [(ActionStatus.PLANNED, None)]

        restarted = DaemonProcess(daemon.env, daemon.log)
        restarted.start()
        try:
            wait_for_value(
                "the restarted daemon to adopt the job",
                lambda: _resubmissions(database),
                lambda rows: rows == [(ActionStatus.DONE, submitted)],
                timeout_s=60,
            )
        finally:
            restarted.stop_if_running()

    tagged = [
        job_id
        for job_id, info in cluster.client.jobs_of_user(os.geteuid()).items()
        if run_id_from_comment(info.comment) == RUN_ID
    ]
    assert sorted(tagged) == sorted([first, submitted])  # exactly one job for the new attempt
    with database.session() as s:
        attempts = s.scalars(select(Attempt).order_by(Attempt.number)).all()
        assert [a.slurm_job_id for a in attempts] == [first, submitted]
    database.dispose()
