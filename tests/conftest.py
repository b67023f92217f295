"""Shared test policy.

Tests that need a real component (the local Slurm cluster, PostgreSQL, torch, the two test
users of `scripts/test-users`, network namespaces, an NVIDIA GPU) carry a marker. Where the
component is absent they are skipped in a developer's ad-hoc run, but `scripts/test` (and so CI)
sets SLURMFT_TEST_REQUIRE=slurm,postgres,torch,users,netns, which turns every such skip into a
failure: the real-component tests always run in CI. The `gpu` tests are the exception: CI has no
GPU, so they skip there and run where a driver is (SLURMFT_TEST_REQUIRE=gpu on such a machine
makes a missing driver a failure). Each is the real half of a contract whose fake half runs
everywhere.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/ has no packages (importlib import mode): its helper modules are imported by path.
sys.path.insert(0, str(Path(__file__).parent))

from slurm_clusters import xdist_worker_index
from unix_users import TestUsers, make_test_users, missing_users

COMPONENTS = ("slurm", "postgres", "torch", "users", "netns", "gpu")

REQUIRED = {
    name.strip() for name in os.environ.get("SLURMFT_TEST_REQUIRE", "").split(",") if name.strip()
}


def _available(component: str) -> tuple[bool, str]:
    if component == "slurm":
        ok = bool(os.environ.get("SLURM_CONF")) and shutil.which("sbatch") is not None
        return ok, "the local Slurm cluster is not up (scripts/slurm-cluster up; export SLURM_CONF)"
    if component == "postgres":
        return bool(os.environ.get("SLURMFT_TEST_POSTGRES_URL")), (
            "no PostgreSQL server (SLURMFT_TEST_POSTGRES_URL is unset; scripts/test starts one)"
        )
    if component == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            return False, "torch is not installed (pip install torch==2.13.0)"
        return True, ""
    if component == "users":
        if os.geteuid() != 0:
            return False, "the multi-user tests need root (they switch to the test users)"
        missing = missing_users()
        return not missing, f"no test users {', '.join(missing)} (run: scripts/test-users up)"
    if component == "netns":
        if os.geteuid() != 0:
            return False, "the network-namespace tests need root (ip netns)"
        return shutil.which("ip") is not None, "no `ip` command (apt-get install iproute2)"
    if component == "gpu":
        return _nvidia_gpu()
    raise ValueError(component)


@functools.cache
def _nvidia_gpu() -> tuple[bool, str]:
    """Whether NVML sees a GPU; asked once (nvmlInit takes a while on a real driver)."""
    try:
        import pynvml
    except ImportError:
        return False, "pynvml is not installed (package nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return False, f"no NVIDIA driver on this machine (NVML: {error})"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()  # the tests start NVML themselves: leave it as found
    return count > 0, "NVML sees no NVIDIA GPU"


def require(component: str) -> None:
    """Skip (ad hoc) or fail (under scripts/test) when a real component is missing."""
    ok, why = _available(component)
    if ok:
        return
    if component in REQUIRED:
        pytest.fail(f"required component missing: {why}", pytrace=False)
    pytest.skip(why)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "users: needs the test users (scripts/test-users up)")
    config.addinivalue_line("markers", "netns: needs root and iproute2 (network namespaces)")
    use_the_workers_cluster()


def use_the_workers_cluster() -> None:
    """Under pytest-xdist every worker drives a local Slurm cluster of its own.

    `scripts/test` starts one cluster per worker and lists their roots, in worker order, in
    SLURMFT_TEST_CLUSTER_ROOTS; worker gwN points SLURM_CONF (which every Slurm test and helper
    reads) at the Nth. Two workers on one cluster would see each other's jobs, drains and node
    kills, so a worker without a cluster of its own stops the session."""
    index = xdist_worker_index()
    roots = os.environ.get("SLURMFT_TEST_CLUSTER_ROOTS", "").split()
    if index is None or not roots:
        return
    if index >= len(roots):
        pytest.exit(
            f"worker gw{index} has no Slurm cluster of its own: SLURMFT_TEST_CLUSTER_ROOTS lists "
            f"{len(roots)} (start one per worker, as scripts/test does)",
            returncode=4,
        )
    os.environ["SLURM_CONF"] = str(Path(roots[index]) / "etc" / "slurm.conf")


# Marks of tests that start Slurm jobs or torch processes, need the test users or network
# namespaces, or hold a time bound; and the folders whose tests start Slurm clusters or node
# agents. None of them runs in the background.
NOT_IN_BACKGROUND = ("serial", "slurm", "torch", "users", "netns")
CLUSTER_FOLDERS = (("integration", "slurm"), ("integration", "agent"))
TESTS = Path(__file__).parent


def runs_in_background(item: pytest.Item) -> bool:
    """The background tests need no Slurm cluster, no node agent, no torch process and no test
    users, and hold no time bound: the unit tests and the modules directly in tests/integration
    (the store, the daemon's servers, the command line), less those marked as in
    NOT_IN_BACKGROUND. scripts/test runs them at idle CPU priority beside the serial group, which
    leaves most of the two cores idle (docs/testing.md). Not the training runs: beside the serial
    group, even at idle priority, their process starts slowed its end-to-end tests by a fifth."""
    if Path(item.path).relative_to(TESTS).parts[:2] in CLUSTER_FOLDERS:
        return False
    return not any(item.get_closest_marker(mark) for mark in NOT_IN_BACKGROUND)


# Which tests each SLURMFT_TEST_PHASE keeps (scripts/test): `parallel` every test not in the serial
# group; with idle CPU beside the serial group, that part is split into `heavy` (the workers'
# phase: the rest) and `background` (beside the serial group).
PHASES = {
    "parallel": lambda item: item.get_closest_marker("serial") is None,
    "heavy": lambda item: (
        item.get_closest_marker("serial") is None and not runs_in_background(item)
    ),
    "background": runs_in_background,
    "serial": lambda item: item.get_closest_marker("serial") is not None,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """SLURMFT_TEST_PHASE (one of PHASES) keeps that phase's tests; unset keeps all."""
    phase = os.environ.get("SLURMFT_TEST_PHASE", "")
    if not phase:
        return
    if phase not in PHASES:
        raise pytest.UsageError(f"SLURMFT_TEST_PHASE must be one of {tuple(PHASES)}, not {phase!r}")
    keep, drop = [], []
    for item in items:
        (keep if PHASES[phase](item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    for component in COMPONENTS:
        if item.get_closest_marker(component) is not None:
            require(component)


@pytest.fixture(scope="session")
def test_users() -> Iterator[TestUsers]:
    """Two real unprivileged users, `test_users.alice` and `test_users.bob` (slurmft-alice and
    slurmft-bob: not root, not SlurmUser, no Slurm Operators), each a `UnixUser` with

    - `pw` (the passwd entry), `name`, `uid`, `gid`, `home`;
    - `run(argv, env=None, timeout=120, **subprocess_kwargs)`: run a command as the user (real
      uid, gid and supplementary groups; cwd its home unless given; output captured as text;
      exit status returned, not checked) and `popen(argv, env=None, **kwargs)` to start one;
    - `env(env)`: the environment those get: ``env`` (default: PATH, LANG and SLURM_CONF) with the
      user's HOME/USER/LOGNAME/SHELL and the shared environment's bin/ first on PATH;
    - `slurmft`: the `slurmft` command the user runs; `own(path)`: a directory made theirs;
    - `slurm_client(slurm_conf)`: a CliSlurmClient whose sbatch/scontrol/... run as the user.

    The users cannot reach this checkout or its .venv (they may be under /root): `slurmft`,
    `python` and their PATH point at a world-readable copy of the environment made for this
    session from the current code (see tests/unix_users.py). Jobs a user submits to the local
    Slurm cluster run as that user, so give them directories they own (`own`) outside pytest's
    private tmp_path (mkdtemp under /tmp). Skips, or fails under SLURMFT_TEST_REQUIRE=users,
    unless run as root with both users present (`scripts/test-users up`)."""
    require("users")
    users = make_test_users()
    try:
        yield users
    finally:
        users.shared.remove()
