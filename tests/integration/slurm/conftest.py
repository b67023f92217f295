"""The real local Slurm cluster for the contract tests (scripts/slurm-cluster up; SLURM_CONF)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/ has no packages (importlib import mode): put this folder on the path for its helpers.
sys.path.insert(0, str(Path(__file__).parent))

from daemon_process import DaemonProcess, running_daemon
from local_cluster import Cluster

from slurmft.slurm.cli_backend import CliSlurmClient


@pytest.fixture(scope="session")
def slurm_conf() -> Path:
    return Path(os.environ["SLURM_CONF"])


@pytest.fixture(scope="session")
def client(slurm_conf: Path) -> CliSlurmClient:
    return CliSlurmClient(slurm_conf=str(slurm_conf), timeout_s=20)


@pytest.fixture
def cluster(client: CliSlurmClient, slurm_conf: Path, tmp_path: Path) -> Iterator[Cluster]:
    # Job output lands in tmp_path, written by slurmd (root) on this same host.
    tmp_path.chmod(0o777)
    cluster = Cluster(client, slurm_conf, tmp_path)
    try:
        yield cluster
    finally:
        cluster.undo()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """`slurmft daemon` on a fresh SQLite store (tests that need other settings override it)."""
    with running_daemon(tmp_path) as process:
        yield process


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's own tmp_path is private to root). A test with
    jobs writing in it asks for it before `cluster`, so that it is removed after their end."""
    path = Path(tempfile.mkdtemp(prefix="slurmft-users-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
