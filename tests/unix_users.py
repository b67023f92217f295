"""Two real unprivileged users for tests that need more than one identity (the ``test_users``
fixture in tests/conftest.py; created by ``scripts/test-users up``).

The users cannot read what root keeps private, and the checkout (with its ``.venv``) may live
anywhere: under /root, under a 0700 home, or in a pyenv interpreter they cannot run. So they do
not run this checkout's environment: they run a copy of it in a fresh world-readable directory
(``SharedVenv``), made once per test session from the code as it is now. The copy hard-links the
files where it can (same filesystem: about a second), else copies them, and runs on an
interpreter of the same Python version that the users can execute.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.runner import CommandResult, SubprocessRunner

ALICE, BOB = "slurmft-alice", "slurmft-bob"
NAMES = (ALICE, BOB)
REPO = Path(__file__).resolve().parents[1]
# What the shared copy needs of the checkout: the package (with the example training scripts)
# and the migrations, which `slurmft.db` finds beside the package.
SOURCE_DIRS = ("slurmft", "migrations")
LOGIN_PATH = "/usr/local/bin:/usr/bin:/bin"


def missing_users() -> list[str]:
    missing = []
    for name in NAMES:
        try:
            pwd.getpwnam(name)
        except KeyError:
            missing.append(name)
    return missing


@dataclass(frozen=True)
class UnixUser:
    """One test user: its passwd entry, and commands run as it (real uid, gid and groups)."""

    pw: pwd.struct_passwd
    bin_dir: Path  # the shared environment's bin/, first on the user's PATH

    @property
    def name(self) -> str:
        return self.pw.pw_name

    @property
    def uid(self) -> int:
        return self.pw.pw_uid

    @property
    def gid(self) -> int:
        return self.pw.pw_gid

    @property
    def home(self) -> Path:
        return Path(self.pw.pw_dir)

    @property
    def slurmft(self) -> str:
        """The `slurmft` command this user can run (the shared environment's)."""
        return str(self.bin_dir / "slurmft")

    def env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: a login-like environment with SLURM_CONF) with this user's
        identity (HOME, USER, LOGNAME, SHELL) and the shared environment first on PATH."""
        base = dict(env) if env is not None else _login_env()
        path = base.get("PATH", LOGIN_PATH)
        return base | {
            "HOME": self.pw.pw_dir,
            "USER": self.name,
            "LOGNAME": self.name,
            "SHELL": self.pw.pw_shell,
            "PATH": f"{self.bin_dir}:{path}",
        }

    def popen_args(self, env: Mapping[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Keyword arguments for subprocess: this user's uid, gid and groups, its environment,
        and its home as the working directory (unless ``cwd`` is given)."""
        return {
            "user": self.uid,
            "group": self.gid,
            "extra_groups": os.getgrouplist(self.name, self.gid),
            "env": self.env(env),
            "cwd": kwargs.pop("cwd", self.pw.pw_dir),
            **kwargs,
        }

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        timeout: float = 120,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as this user; text output captured; the exit status is not checked."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(
            list(argv), text=True, timeout=timeout, check=False, **self.popen_args(env, **kwargs)
        )

    def popen(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as this user (a long-lived process: a daemon, a watcher)."""
        return subprocess.Popen(list(argv), **self.popen_args(env, **kwargs))

    def slurm_client(self, slurm_conf: str, timeout_s: float = 30) -> CliSlurmClient:
        """A Slurm client whose commands (sbatch, scontrol, ...) run as this user, with this
        user's environment (a job submitted with it inherits that environment)."""
        return CliSlurmClient(_AsUser(self, slurm_conf), timeout_s=timeout_s)

    def own(self, path: Path) -> Path:
        """Make ``path`` (a directory, created if missing) this user's, reachable by others."""
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        path.chmod(0o755)
        return path


class _AsUser(SubprocessRunner):
    def __init__(self, user: UnixUser, slurm_conf: str) -> None:
        super().__init__(user.env({"SLURM_CONF": slurm_conf, "PATH": os.environ["PATH"]}))
        self._setpriv = [
            "setpriv",
            f"--reuid={user.uid}",
            f"--regid={user.gid}",
            "--init-groups",
            "--",
        ]

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        return super().run([*self._setpriv, *argv], timeout, stdin=stdin)


def _login_env() -> dict[str, str]:
    env = {"PATH": LOGIN_PATH, "LANG": os.environ.get("LANG", "C.UTF-8")}
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    return env


class SharedVenv:
    """A world-readable copy of the running virtual environment, with this checkout's code."""

    def __init__(self, runner: UnixUser) -> None:
        self._runner = runner  # an unprivileged user that must be able to run it
        self.root = Path(tempfile.mkdtemp(prefix="slurmft-users-venv-"))
        self.root.chmod(0o755)
        self.venv = self.root / "venv"
        self.src = self.root / "src"

    @property
    def bin_dir(self) -> Path:
        return self.venv / "bin"

    def build(self) -> SharedVenv:
        interpreter = self._interpreter()
        subprocess.run(
            [interpreter, "-m", "venv", "--without-pip", str(self.venv)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        for name in SOURCE_DIRS:
            _link_tree(REPO / name, self.src / name)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        site = self.venv / "lib" / version / "site-packages"
        site.rmdir()  # empty in a fresh venv; replaced by the running environment's packages
        _link_tree(Path(sysconfig.get_paths()["purelib"]), site)
        self._point_editable_installs_at_src(site)
        self._write_console_script()
        _open_to_all(self.root)
        return self

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _interpreter(self) -> str:
        """An interpreter of this Python version that the users can run: the venv's base one
        when they can reach it, else one on the system PATH."""
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        candidates = [
            str(Path(sys.base_prefix) / "bin" / f"python{version}"),
            *(f"{d}/python{version}" for d in ("/usr/local/bin", "/usr/bin")),
        ]
        probe = "import sys, venv; print('%d.%d' % sys.version_info[:2])"
        for candidate in candidates:
            if not os.path.exists(candidate):
                continue
            try:
                done = self._runner.run([candidate, "-c", probe], cwd="/", timeout=60)
            except PermissionError:  # the user cannot reach or execute it
                continue
            if done.returncode == 0 and done.stdout.strip() == version:
                return candidate
        raise RuntimeError(
            f"no Python {version} that {self._runner.name} can run (tried {candidates}): "
            f"install python{version} (Debian: apt-get install python3-venv)"
        )

    def _point_editable_installs_at_src(self, site: Path) -> None:
        """An editable install's .pth names the checkout, which the users may not reach."""
        for pth in site.glob("*.pth"):
            text = pth.read_text()
            if str(REPO) in text:
                pth.unlink()  # a hard link to the original: never write through it
                pth.write_text(text.replace(str(REPO), str(self.src)))

    def _write_console_script(self) -> None:
        original = Path(sys.prefix) / "bin" / "slurmft"
        body = original.read_text().split("\n", 1)[1]  # after the #! line
        script = self.bin_dir / "slurmft"
        script.write_text(f"#!{self.bin_dir / 'python'}\n{body}")
        script.chmod(0o755)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links refused
        shutil.copy2(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)


def _open_to_all(root: Path) -> None:
    """Directories r-x and files r (x where the owner has it) for everyone. A hard-linked file
    shares its mode with the checkout's: this only ever adds read access."""
    for directory, _dirs, files in os.walk(root):
        _add_mode(Path(directory), stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        for name in files:
            path = Path(directory, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                continue
            wanted = stat.S_IRGRP | stat.S_IROTH
            if mode & stat.S_IXUSR:
                wanted |= stat.S_IXGRP | stat.S_IXOTH
            _add_mode(path, wanted)


def _add_mode(path: Path, bits: int) -> None:
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if mode & bits != bits:
        path.chmod(mode | bits)


@dataclass
class TestUsers:
    """slurmft-alice and slurmft-bob, and the environment they run slurmft from."""

    __test__ = False  # not a test class

    shared: SharedVenv

    @cached_property
    def alice(self) -> UnixUser:
        return UnixUser(pwd.getpwnam(ALICE), self.shared.bin_dir)

    @cached_property
    def bob(self) -> UnixUser:
        return UnixUser(pwd.getpwnam(BOB), self.shared.bin_dir)

    @property
    def slurmft(self) -> str:
        return str(self.shared.bin_dir / "slurmft")

    @property
    def python(self) -> str:
        return str(self.shared.bin_dir / "python")


def make_test_users() -> TestUsers:
    """Build the shared environment (the caller removes it: ``users.shared.remove()``)."""
    runner = UnixUser(pwd.getpwnam(ALICE), Path("/nonexistent"))
    shared = SharedVenv(runner)
    try:
        return TestUsers(shared.build())
    except BaseException:
        shared.remove()
        raise
