"""The run's own folder in its checkpoint directory, ``<ckpt>/.slurmft``: the run's token, the
job's output, the agent steps' outcome folders.

The checkpoint directory is the user's choice and is often shared (a group's project space), so
whoever else can write there could have made ``.slurmft`` first: as a link to a folder of
theirs (the token would be written where they read it), as their own folder, or as one anyone
may write into (the token could be swapped for theirs). So the folder is never trusted as found:
it is made here (mode 0700, never through a link), or, when it exists, opened without following
a link and checked to be a directory owned by the job's user that neither group nor others may
write; anything else is refused with what to do. The token is written through that open folder
into a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) and renamed over the old one, so
a link planted at its name is replaced, never followed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from slurmft.errors import SlurmftError

STATE_DIR = ".slurmft"
TOKEN_FILE = "token"


class StateDirError(SlurmftError):
    """``<ckpt>/.slurmft`` is not a private folder of the job's user; nothing was written."""

    exit_code = 2


def open_state_dir(ckpt_dir: str, *, uid: int | None = None) -> int:
    """A descriptor of ``<ckpt_dir>/.slurmft`` (made if absent), checked to be a real directory
    owned by ``uid`` (default: this process's) and not writable by group or others. The caller
    closes it. Raises StateDirError."""
    uid = os.geteuid() if uid is None else uid
    where = Path(ckpt_dir) / STATE_DIR
    try:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        parent = os.open(ckpt_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise StateDirError(
            f"cannot use the checkpoint directory {ckpt_dir}: {error.strerror}"
        ) from None
    try:
        with contextlib.suppress(FileExistsError):  # mkdir never follows a link: it "exists"
            os.mkdir(STATE_DIR, 0o700, dir_fd=parent)
        try:
            fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as error:  # ELOOP: a link; ENOTDIR: a file
            raise StateDirError(
                f"{where} is not a directory ({error.strerror}: a link or a file someone made): "
                f"remove it, or use a checkpoint directory only you can write"
            ) from None
    except OSError as error:
        raise StateDirError(f"cannot make {where}: {error.strerror}") from None
    finally:
        os.close(parent)
    try:
        _check_private(os.fstat(fd), where, uid)
    except StateDirError:
        os.close(fd)
        raise
    return fd


def _check_private(info: os.stat_result, where: Path, uid: int) -> None:
    if not stat.S_ISDIR(info.st_mode):  # pragma: no cover (O_DIRECTORY already refused it)
        raise StateDirError(f"{where} is not a directory")
    if info.st_uid != uid:
        raise StateDirError(
            f"{where} belongs to uid {info.st_uid}, not to you (uid {uid}): someone else made "
            f"it; remove it, or use a checkpoint directory only you can write"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateDirError(
            f"{where} may be written by group or others (mode {stat.S_IMODE(info.st_mode):03o}): "
            f"`chmod 700 {where}`, then submit again"
        )


def check_state_dir(ckpt_dir: str) -> Path:
    """``<ckpt_dir>/.slurmft``, made or checked as `open_state_dir` does."""
    os.close(open_state_dir(ckpt_dir))
    return Path(ckpt_dir) / STATE_DIR


def write_token(ckpt_dir: str, token: str) -> Path:
    """The run's token in ``<ckpt_dir>/.slurmft/token``, readable by its owner only, where every
    node of the job can read it. Raises StateDirError."""
    folder = open_state_dir(ckpt_dir)
    partial = f".{TOKEN_FILE}.{secrets.token_hex(8)}.tmp"
    try:
        out = os.open(
            partial,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=folder,
        )
        try:
            os.write(out, (token + "\n").encode())
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(partial, TOKEN_FILE, src_dir_fd=folder, dst_dir_fd=folder)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(partial, dir_fd=folder)
        raise StateDirError(
            f"cannot write the run's token in {Path(ckpt_dir) / STATE_DIR}: {error.strerror}"
        ) from None
    finally:
        os.close(folder)
    return Path(ckpt_dir) / STATE_DIR / TOKEN_FILE
