"""One run's bad data stays in that run: a whole control pass (the daemon's own, observe ->
decide -> act) over a real store and recorded real Slurm output, with runs whose stored data
is broken beside runs that are fine (issue 14, item 3)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from support.slurm_recordings import RecordedCluster, ReplayRunner, recorded_jobs

from slurmft.config import load_config
from slurmft.controller.daemon import Daemon
from slurmft.controller.observe import observe
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind, Run
from slurmft.db.states import RunState
from slurmft.slurm.cli_backend import CliSlurmClient

# What `slurmft submit` records (controller.resubmit.submission_record), with one field of the
# wrong type: nodes as a string, as a hand-edited or foreign client's record may have it.
MISTYPED_SUBMISSION: dict[str, Any] = {
    "script": "#!/bin/bash\nexec true\n",
    "job_name": "slurmft-a",
    "run_id": "run-c",
    "nodes": "2",
    "spare_nodes": 0,
    "no_kill": True,
    "requeue": True,
    "exclude": [],
    "workdir": "/tmp",
    "path": "/usr/bin:/bin",
}


def _daemon(tmp_path: Path, database: Database, slurm: CliSlurmClient) -> Daemon:
    config = load_config(
        environ={},
        system_file=tmp_path / "absent.toml",
        overrides=[
            f"paths.state_dir={tmp_path / 'state'}",
            f"paths.runtime_dir={tmp_path / 'run'}",
        ],
    )
    return Daemon(config, database=database, slurm=slurm)


def test_a_bad_job_id_and_a_mistyped_submission_do_not_stop_the_pass_for_other_runs(
    database: Database, seed_run: Callable[..., None], tmp_path: Path
) -> None:
    # Run A's attempt names job "x" (no Slurm job id); run C's job is gone from Slurm and its
    # recorded submission has a mistyped field, so resubmitting it cannot work. Run B's job
    # completed: the pass must still end B's run. A and C come first in the pass.
    seed_run(database, "run-a", job_id="x", submission=dict(MISTYPED_SUBMISSION))
    seed_run(database, "run-c", job_id="999999", submission=dict(MISTYPED_SUBMISSION))
    running, held, done = recorded_jobs()
    seed_run(database, "rec-done", job_id=done)  # run B
    seed_run(database, "rec-held", job_id=held, running=False)
    seed_run(database, "run-0001", job_id=running)
    # squeue for the four real job ids (not "x"), then scontrol for the ended and the gone one.
    cluster = RecordedCluster(
        ["squeue_many", "sinfo_nodes_drained", "show_job_completed", "show_job_unknown"]
    )
    daemon = _daemon(tmp_path, database, CliSlurmClient(cluster))

    daemon.control_pass()

    assert daemon.skipped_because is None
    with database.session() as s:
        assert s.get(Run, "rec-done").state is RunState.COMPLETED  # type: ignore[union-attr]
        (finished,) = s.scalars(select(Action).where(Action.run_id == "rec-done")).all()
        assert (finished.kind, finished.status) == (ActionKind.FINISH_RUN, ActionStatus.DONE)
        # A's bad job id: recorded on A, never asked of Slurm.
        (error,) = s.scalars(select(Event).where(Event.run_id == "run-a")).all()
        assert error.kind is EventKind.CONTROL_ERROR
        assert "not a Slurm job id: 'x'" in error.message
        assert s.get(Run, "run-a").state is RunState.RUNNING  # type: ignore[union-attr]
        # C's record: refused with the field named, a person told; nothing was submitted.
        c_actions = s.scalars(
            select(Action).where(Action.run_id == "run-c").order_by(Action.id)
        ).all()
        assert [(a.kind, a.status) for a in c_actions] == [
            (ActionKind.RESUBMIT, ActionStatus.SKIPPED),
            (ActionKind.NOTIFY, ActionStatus.DONE),
        ]
        assert "'nodes' is str '2', expected int" in (c_actions[0].error or "")
    assert not any(call[0] == "sbatch" for call in cluster.calls)
    assert all("x" not in arg.split("=")[-1].split(",") for call in cluster.calls for arg in call)


def test_a_bad_job_id_is_recorded_once_not_on_every_pass(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "run-a", job_id="14_x")
    seed_run(database, "r14", job_id=recorded_jobs()[0])
    for _ in range(2):
        runner = ReplayRunner(["squeue_requeued", "sinfo_nodes_drained", "show_job_requeued"])
        with database.session() as s:
            view = observe(s, CliSlurmClient(runner), now=datetime.now(UTC))
        assert runner.exhausted  # squeue asked for that job only
        assert {r.run_id: r.job is not None for r in view.runs} == {"run-a": False, "r14": True}
    with database.session() as s:
        errors = s.scalars(select(Event).where(Event.kind == EventKind.CONTROL_ERROR)).all()
        assert [(e.run_id, e.message) for e in errors] == [
            (
                "run-a",
                "control pass: reading its job from Slurm failed: not a Slurm job id: '14_x'; "
                "its job is not read",
            )
        ]
