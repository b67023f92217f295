"""Fixtures over the recorded real Slurm output (see tests/support/slurm_recordings.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support.slurm_recordings import ReplayRunner, load_recording

from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.runner import CommandResult


@pytest.fixture
def recorded() -> Callable[[str], CommandResult]:
    return load_recording


@pytest.fixture
def replay() -> Callable[..., tuple[CliSlurmClient, ReplayRunner]]:
    def make(*names: str) -> tuple[CliSlurmClient, ReplayRunner]:
        runner = ReplayRunner(names)
        return CliSlurmClient(runner), runner

    return make
