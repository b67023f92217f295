"""The batch step on a full or read-only checkpoint filesystem (issue 14 item 14): it keeps
supervising the agent steps, logs the failure, and saves its state again once it can.

The agent step is a stand-in `srun` on PATH (a shell script); the failure is injected where the
state's writes go (`BatchState.save`) as the OSError the kernel gives, and the outcome folder is
made impossible for real (a file where its parent folder should be)."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from slurmft.agent.batch import STATE_FILE, BatchSpec, BatchState
from slurmft.agent.batch_step import BatchStep
from slurmft.core.exits import BatchExit
from slurmft.slurm.api import JobInfo, NodeInfo, SignalTarget
from slurmft.slurm.states import JobState, parse_node_state

SPEC = BatchSpec(run_id="r1", nodes=1, spares=0, script=("train.py",), ckpt_dir="", slurmft="x")


class OneNodeJob:
    """The SlurmClient calls the batch step's loop makes, for a job holding n1."""

    def job(self, job_id: str) -> JobInfo:
        return JobInfo(job_id, JobState.RUNNING, nodes=("n1",))

    def nodes(self, names: Sequence[str]) -> dict[str, NodeInfo]:
        return {name: NodeInfo(name, parse_node_state("ALLOCATED")) for name in names}

    def signal(self, job_id: str, signal: str, target: SignalTarget) -> None:
        pass

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        raise AssertionError("a job that finishes is not requeued")


def _fake_srun(folder: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`srun` on PATH: the agent step, as `body` (a shell script) says; $0's calls counted."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        f'#!/bin/sh\nn=$(cat "{folder}/calls" 2>/dev/null || echo 0)\n'
        f'echo $((n + 1)) > "{folder}/calls"\n{body}\n'
    )
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def _disk(monkeypatch: pytest.MonkeyPatch, full: Callable[[], bool], code: int) -> list[int]:
    """BatchState.save fails with `code` while `full()`; returns the failed calls' count."""
    failed = [0]
    save = BatchState.save

    def injected(self: BatchState, ckpt_dir: str) -> None:
        if full():
            failed[0] += 1
            raise OSError(code, os.strerror(code), str(Path(ckpt_dir)))
        save(self, ckpt_dir)

    monkeypatch.setattr(BatchState, "save", injected)
    return failed


def test_a_full_checkpoint_filesystem_is_survived_and_the_state_saved_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = ckpt / STATE_FILE
    # First step: room comes back ("freed"), the step waits for the batch step's next poll to
    # save the state, keeps what it saw, and fails. Second step: training finishes.
    _fake_srun(
        tmp_path,
        f'if [ "$n" = 0 ]; then touch "{tmp_path}/freed"\n'
        f'  for i in $(seq 200); do [ -f "{state}" ] && break; sleep 0.05; done\n'
        f'  cp "{state}" "{tmp_path}/seen-in-step-1"; exit 1; fi\nexit 0',
        monkeypatch,
    )
    failed = _disk(monkeypatch, lambda: not (tmp_path / "freed").exists(), errno.ENOSPC)
    spec = dataclasses.replace(SPEC, ckpt_dir=str(ckpt))
    batch = BatchStep(spec, OneNodeJob(), "7", "127.0.0.1", poll_s=0.05)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="slurmft.batch"):
        assert batch._loop() is BatchExit.FINISHED
    assert failed[0] == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot save the batch state" in errors[0]
    assert "No space left on device (ENOSPC)" in errors[0]
    assert any("batch state saved again" in r.getMessage() for r in caplog.records)
    # Saved during the first step, by a poll; and at the end with both steps and the failure.
    assert json.loads((tmp_path / "seen-in-step-1").read_text())["step_launches"] == 1
    final = json.loads(state.read_text())
    assert final["step_launches"] == 2 and final["restarts_without_progress"] == 1
    assert batch.unsaved is None


def test_a_read_only_checkpoint_filesystem_leaves_the_agent_steps_supervised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".slurmft").write_text("")  # no outcome folder can be made under it
    _fake_srun(tmp_path, 'if [ "$n" = 0 ]; then exit 1; fi\nexit 0', monkeypatch)
    failed = _disk(monkeypatch, lambda: True, errno.EROFS)
    spec = dataclasses.replace(SPEC, ckpt_dir=str(ckpt))
    batch = BatchStep(spec, OneNodeJob(), "7", "127.0.0.1", poll_s=0.05)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="slurmft.batch"):
        assert batch._loop() is BatchExit.FINISHED  # relaunched after the failed step, then done
    assert (tmp_path / "calls").read_text().strip() == "2"
    assert failed[0] >= 3  # each change tried to save
    assert batch.state.step_launches == 2 and batch.state.budget.restarts_without_progress == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    saves = [e for e in errors if "cannot save the batch state" in e]
    assert (
        len(saves) == 1 and "Read-only file system (EROFS)" in saves[0]
    )  # logged once, not at every try
    assert sum("outcome folder" in e for e in errors) == 2
    assert not (ckpt / STATE_FILE).exists() and batch.unsaved is not None


def test_a_folder_named_like_a_checkpoint_with_other_digits_is_no_checkpoint(
    tmp_path: Path,
) -> None:
    """`"²".isdigit()` is true and `int("²")` raises: such a folder stopped the batch step."""
    from slurmft.agent.batch import checkpoint_step, newest_checkpoint

    (tmp_path / "step-000000003").mkdir()
    (tmp_path / "step-\u00b2").mkdir()
    assert checkpoint_step(newest_checkpoint(str(tmp_path))) is None
    assert checkpoint_step("step-000000003") == 3
