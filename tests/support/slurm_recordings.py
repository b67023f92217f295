"""Recorded real Slurm output (tests/fixtures/slurm/) and two fake runners that replay it.

Both check that the client asks for exactly the argv that was recorded from the real command,
so the parsers are only ever fed output that real Slurm printed for that argv. ReplayRunner
answers a given sequence of calls in order; RecordedCluster answers any call from the
recordings of one moment of the recorded cluster (the Slurm contract's fake half,
tests/integration/slurm/test_slurm_contract.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from slurmft.slurm.api import JobInfo
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.runner import CommandResult

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
RECORDED_VERSION = "22.05"


def load_recording(name: str, version: str = RECORDED_VERSION) -> CommandResult:
    data = json.loads((FIXTURES / version / f"{name}.json").read_text())
    return CommandResult(tuple(data["argv"]), data["returncode"], data["stdout"], data["stderr"])


class ReplayRunner:
    """Answers each call with the next recording, after checking the argv is the recorded one."""

    def __init__(self, names: Sequence[str]) -> None:
        self._queue = [load_recording(name) for name in names]
        self.calls: list[tuple[str, ...]] = []

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        assert self._queue, f"unexpected call: {list(argv)}"
        recording = self._queue.pop(0)
        assert tuple(argv) == recording.argv, "the client asked something else than was recorded"
        assert timeout > 0
        self.calls.append(tuple(argv))
        return recording

    @property
    def exhausted(self) -> bool:
        return not self._queue


class RecordedCluster:
    """The recorded cluster at one moment: each call is answered with the recording of its
    argv among that moment's recordings; an argv not recorded then fails the test."""

    def __init__(self, names: Sequence[str]) -> None:
        self.calls: list[tuple[str, ...]] = []
        self._answers: dict[tuple[str, ...], CommandResult] = {}
        self.at(*names)

    def at(self, *names: str) -> None:
        """Move to the moment these recordings were taken in (one recording per argv)."""
        recordings = {name: load_recording(name) for name in names}
        self._answers = {recording.argv: recording for recording in recordings.values()}
        assert len(self._answers) == len(recordings), f"two of {names} answer the same argv"

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        assert tuple(argv) in self._answers, f"not recorded at this moment: {list(argv)}"
        assert timeout > 0
        self.calls.append(tuple(argv))
        return self._answers[tuple(argv)]


def jobs_asked(result: CommandResult) -> list[str]:
    """The job ids a recorded squeue call asked for."""
    jobs = next(arg for arg in result.argv if arg.startswith("--jobs="))
    return jobs.removeprefix("--jobs=").split(",")


def job_id_of(result: CommandResult) -> str:
    return result.argv[-1]


def recorded_jobs() -> tuple[str, str, str]:
    """The recording's running, held and completed jobs, as squeue_many asked for them
    (record.py submits them first). Tests seed their runs with these ids: a new recording
    numbers them anew."""
    running, held, done, _unknown = jobs_asked(load_recording("squeue_many"))
    return running, held, done


class RecordedJobs(CliSlurmClient):
    """The recorded running and completed jobs and the drained partition, each job read alone
    (no squeue of several tracked ids is recorded); a cancel is kept in ``cancelled``, not
    sent."""

    def __init__(self) -> None:
        names = ["show_job_running", "show_job_completed", "sinfo_nodes_drained"]
        super().__init__(RecordedCluster(names))
        self.cancelled: list[str] = []

    def jobs(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        return {job_id: self.job(job_id) for job_id in job_ids}

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)
