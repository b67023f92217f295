"""Slurm's job record → the store's run and attempt bookkeeping, as a table."""

from __future__ import annotations

import pytest

from slurmft.controller.reconcile import AttemptChange, attempt_change
from slurmft.db.states import AttemptState as A
from slurmft.db.states import RunState as R
from slurmft.slurm.api import JobInfo
from slurmft.slurm.states import JobState as J

NOTHING = AttemptChange()
# name, run state, attempt state, restarts recorded, Slurm job state, Slurm restarts, change
CASES = [
    ("queued, still queued", R.PENDING, A.SUBMITTED, 0, J.PENDING, 0, NOTHING),
    (
        "starts running",
        R.PENDING,
        A.SUBMITTED,
        0,
        J.RUNNING,
        0,
        AttemptChange(state=A.RUNNING, run_state=R.RUNNING),
    ),
    ("keeps running", R.RUNNING, A.RUNNING, 0, J.RUNNING, 0, NOTHING),
    ("completing still holds nodes", R.RUNNING, A.RUNNING, 0, J.COMPLETING, 0, NOTHING),
    (
        "back in the queue: requeued",
        R.RUNNING,
        A.RUNNING,
        0,
        J.PENDING,
        0,
        AttemptChange(requeued=True, run_state=R.RECOVERING),
    ),
    (
        "requeued and running again (scontrol's restart count)",
        R.RUNNING,
        A.RUNNING,
        0,
        J.RUNNING,
        1,
        AttemptChange(requeued=True, state=A.RUNNING),
    ),
    (
        "requeued, still completing on the old nodes (scontrol's restart count)",
        R.RUNNING,
        A.RUNNING,
        0,
        J.COMPLETING,
        1,
        AttemptChange(requeued=True, run_state=R.RECOVERING),
    ),
    (
        "the requeued attempt starts: the run runs again",
        R.RECOVERING,
        A.SUBMITTED,
        1,
        J.RUNNING,
        1,
        AttemptChange(state=A.RUNNING, run_state=R.RUNNING),
    ),
    (
        "ends on its time limit",
        R.RUNNING,
        A.RUNNING,
        0,
        J.TIMEOUT,
        0,
        AttemptChange(state=A.TIMEOUT),
    ),
    ("node failure", R.RUNNING, A.RUNNING, 0, J.NODE_FAIL, 0, AttemptChange(state=A.NODE_FAIL)),
    (
        "out of memory is a failure",
        R.RUNNING,
        A.RUNNING,
        0,
        J.OUT_OF_MEMORY,
        0,
        AttemptChange(state=A.FAILED),
    ),
    (
        "ran and completed between two looks",
        R.PENDING,
        A.SUBMITTED,
        0,
        J.COMPLETED,
        0,
        AttemptChange(state=A.COMPLETED),
    ),
    ("an ended attempt stays ended", R.RUNNING, A.COMPLETED, 0, J.COMPLETED, 0, NOTHING),
    ("a finished run is not touched", R.COMPLETED, A.COMPLETED, 0, J.COMPLETED, 0, NOTHING),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_attempt_change_table(case: tuple[object, ...]) -> None:
    _, run, attempt, recorded, job, restarts, expected = case
    info = JobInfo("7", job, restarts=restarts)  # type: ignore[arg-type]
    assert attempt_change(run, attempt, recorded, info) == expected  # type: ignore[arg-type]
