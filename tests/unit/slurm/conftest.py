"""Fixtures over the recorded real Slurm output (see slurm_recordings.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# tests/ has no packages (importlib import mode): put this folder on the path for its helpers.
sys.path.insert(0, str(Path(__file__).parent))

from slurm_recordings import ReplayRunner, load_recording

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
