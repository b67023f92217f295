"""A root daemon's resubmission takes nothing from the owner's choices with its own rights
(issue 14 item 6): the child enters the recorded working directory only after it has become
the owner, and runs the daemon's sbatch, never one that the recorded PATH finds."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from unix_users import TestUsers

from slurmft.controller.resubmit import (
    WAITING_FOR_OWNER,
    OwnerRunner,
    OwnerSubmitter,
    SubmissionError,
    submission_record,
)
from slurmft.db.models import Run
from slurmft.slurm.api import SubmitRequest

pytestmark = pytest.mark.users


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="slurmft-resubmit-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _program(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _runner(users: TestUsers, workdir: Path, path: str, search: str | None = None) -> OwnerRunner:
    alice = users.alice
    env = {"HOME": str(alice.home), "USER": alice.name, "PATH": path}
    return OwnerRunner(alice.pw, env, str(workdir), switch_user=True, search_path=search)


def test_the_workdir_is_entered_with_the_owners_rights_not_the_daemons(
    test_users: TestUsers, open_dir: Path
) -> None:
    """bob's private folder holds a folder anyone may list: alice cannot reach it, a root
    daemon can. A resubmission recorded with that working directory must not start there."""
    bob = test_users.bob
    private = bob.own(open_dir / "bob")
    private.chmod(0o700)
    inside = bob.own(private / "inside")
    (inside / "bob-secret-name").write_text("")
    runner = _runner(test_users, inside, "/usr/bin:/bin")
    with pytest.raises(SubmissionError, match="cannot enter it") as refused:
        runner.run(["ls"], timeout=20)
    assert "Permission denied" in str(refused.value) and WAITING_FOR_OWNER in str(refused.value)


def test_the_command_is_the_daemons_not_the_one_on_the_recorded_path(
    test_users: TestUsers, open_dir: Path
) -> None:
    workdir = test_users.alice.own(open_dir / "alice")
    planted = _program(open_dir / "planted", "id", "echo hijacked")
    recorded = f"{planted.parent}:/usr/bin:/bin"
    result = _runner(test_users, workdir, recorded).run(["id", "-un"], timeout=20)
    assert result.stdout.strip() == test_users.alice.name  # the daemon's id, not the planted one
    # The recorded PATH still is the job's environment (sbatch exports it into the job), and
    # the child runs in the recorded directory.
    shown = _runner(test_users, workdir, recorded).run(["sh", "-c", 'echo "$PATH"; pwd'], 20)
    assert shown.stdout.split() == [recorded, str(workdir)]
    # A relative entry of the daemon's own PATH is not searched either.
    with pytest.raises(SubmissionError, match="not on the daemon's PATH"):
        _runner(test_users, workdir, recorded, search="bin:.").run(["no-such-cmd"], 20)


def test_a_resubmission_runs_the_daemons_sbatch_as_the_owner_in_the_workdir(
    test_users: TestUsers, open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the executor's submitter: the sbatch on the daemon's PATH (a recording stand-in
    here) runs as alice in her directory; the one her recorded PATH puts first never runs."""
    alice = test_users.alice
    workdir = alice.own(open_dir / "alice")
    planted = _program(open_dir / "planted", "sbatch", "echo 666")
    daemons = _program(open_dir / "daemon-bin", "sbatch", "{ id -un; pwd; } > who; echo 4242")
    monkeypatch.setenv("PATH", f"{daemons.parent}:{os.environ['PATH']}")
    request = SubmitRequest(script="#!/bin/bash\ntrue\n", job_name="x", run_id="rowner", nodes=1)
    record = submission_record(request, workdir=str(workdir), path=f"{planted.parent}:/usr/bin")
    run = Run(
        id="rowner",
        name="owner",
        owner_uid=alice.uid,
        owner_name=alice.name,
        nodes=1,
        command=["train.py"],
        submission=record,
    )
    submitter = OwnerSubmitter(slurm_conf=None, timeout_s=20, daemon_uid=0)
    assert submitter(run, frozenset(), 1) == "4242"
    assert (workdir / "who").read_text().split() == [alice.name, str(workdir)]
    assert stat.S_IMODE((workdir / "who").stat().st_mode) & 0o002 == 0
    assert (workdir / "who").stat().st_uid == alice.uid
