"""The run's folder in its checkpoint directory (issue 14 item 11): `<ckpt>/.slurmft` is made
private or checked, never trusted as found, and the token write never follows a link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slurmft.agent.state_dir import StateDirError, check_state_dir
from slurmft.api.submission import write_token

TOKEN = "s3cret-token"


def test_a_fresh_state_dir_is_private_and_the_token_is_the_owners_only(tmp_path: Path) -> None:
    path = write_token(str(tmp_path / "ckpt"), TOKEN)
    assert path == tmp_path / "ckpt" / ".slurmft" / "token"
    assert path.read_text() == TOKEN + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    assert write_token(str(tmp_path / "ckpt"), "next").read_text() == "next\n"  # replaced
    assert sorted(p.name for p in path.parent.iterdir()) == ["token"]  # no partial left


def test_a_state_dir_that_is_a_link_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".slurmft").symlink_to(elsewhere)
    with pytest.raises(StateDirError, match="is not a directory"):
        write_token(str(ckpt), TOKEN)
    assert list(elsewhere.iterdir()) == []


def test_a_token_name_that_is_a_link_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious\n")
    ckpt = tmp_path / "ckpt"
    check_state_dir(str(ckpt))
    (ckpt / ".slurmft" / "token").symlink_to(target)
    path = write_token(str(ckpt), TOKEN)
    assert target.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_text() == TOKEN + "\n"


def test_a_state_dir_others_may_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt" / ".slurmft"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with pytest.raises(StateDirError, match=r"written by group or others \(mode 777\)"):
        write_token(str(tmp_path / "ckpt"), TOKEN)
    assert list(folder.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user owns needs root")
def test_a_state_dir_another_user_made_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt" / ".slurmft"
    folder.mkdir(parents=True, mode=0o700)
    os.chown(folder, 15002, 15002)
    with pytest.raises(StateDirError, match="belongs to uid 15002, not to you"):
        write_token(str(tmp_path / "ckpt"), TOKEN)
    assert list(folder.iterdir()) == []


def test_a_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".slurmft").write_text("")
    with pytest.raises(StateDirError, match="is not a directory"):
        check_state_dir(str(tmp_path))
