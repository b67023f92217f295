"""Runs of the example training script shared by the train tests.

Each run takes a few seconds (three processes importing torch on two cores), so runs are
session fixtures reused by several assertions where that is honest.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The test modules here import the run helpers; this directory is not a package (no
# __init__.py anywhere under tests/), so it is put on the path once, here.
sys.path.insert(0, str(Path(__file__).parent))

from tiny_runs import TinyRun, run_tiny


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    """20 uninterrupted steps at world size 3, checkpoints every 5 steps (10, 15, 20 kept),
    an evaluation every 4 steps."""
    run = run_tiny(tmp_path_factory.mktemp("baseline"), "--steps", "20", "--eval-every", "4")
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="session")
def interrupted_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    """The same run, killed twice: rank 0 is SIGKILLed in the middle of the step-10 save (all
    shards written, manifest not yet published), then SIGKILLed after step 13."""
    run = run_tiny(
        tmp_path_factory.mktemp("interrupted"),
        "--steps",
        "20",
        "--eval-every",
        "4",
        "--kill-during-save",
        "10@0",
        "--crash-at-step",
        "13@1",
        "--fault-rank",
        "0",
        max_restarts=2,
    )
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
