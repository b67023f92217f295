"""The example the demo and the end-to-end tests run is a model that learns: at its defaults, a
long run stays finite and its loss falls (at the old default learning rate it went NaN from
about step 40, and the demo showed a model that diverged)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
from tiny_runs import run_tiny

pytestmark = [pytest.mark.torch]


def test_a_thousand_steps_at_the_defaults_stay_finite_and_the_loss_falls(tmp_path: Path) -> None:
    run = run_tiny(tmp_path, "--steps", "1000", "--ckpt-every", "500", nproc=2)
    assert run.returncode == 0, run.output[-4000:]
    losses = {step: record["loss"] for step, record in run.steps().items()}
    assert sorted(losses) == list(range(1, 1001))
    assert [s for s, loss in losses.items() if not math.isfinite(loss)] == []
    first = statistics.fmean(losses[s] for s in range(1, 51))
    last = statistics.fmean(losses[s] for s in range(951, 1001))
    assert last <= first / 2, (first, last)
