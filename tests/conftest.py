"""Shared test policy.

Tests that need a real component (the local Slurm cluster, PostgreSQL, torch) carry a marker.
Where the component is absent they are skipped in a developer's ad-hoc run, but `scripts/test`
(and so CI) sets SLURMFT_TEST_REQUIRE=slurm,postgres,torch, which turns every such skip into a
failure: the real-component tests always run in CI.
"""

from __future__ import annotations

import os
import shutil

import pytest

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
    raise ValueError(component)


def require(component: str) -> None:
    """Skip (ad hoc) or fail (under scripts/test) when a real component is missing."""
    ok, why = _available(component)
    if ok:
        return
    if component in REQUIRED:
        pytest.fail(f"required component missing: {why}", pytrace=False)
    pytest.skip(why)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for component in ("slurm", "postgres", "torch"):
        if item.get_closest_marker(component) is not None:
            require(component)
