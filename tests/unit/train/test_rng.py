from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytestmark = pytest.mark.torch


def draw() -> tuple[float, float, list[float]]:
    import torch

    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_a_restored_state_replays_the_same_random_numbers() -> None:
    from slurmft.train.rng import capture_rng_state, restore_rng_state

    random.seed(1)
    np.random.seed(2)
    draw()
    state = json.loads(json.dumps(capture_rng_state()))  # it must survive JSON
    expected = draw()
    draw()
    restore_rng_state(state)
    assert draw() == expected
