"""`slurmft agent run --nproc-per-node gpu`: one worker per GPU Slurm gave the node's step."""

from __future__ import annotations

import pytest

from slurmft.cli.agent_cmd import resolve_nproc_per_node
from slurmft.config import ConfigError


def test_gpu_is_the_gpus_slurm_gave_this_step() -> None:
    assert resolve_nproc_per_node("gpu", {"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert resolve_nproc_per_node("4", {}) == 4


@pytest.mark.parametrize("environ", [{}, {"SLURM_GPUS_ON_NODE": "0"}, {"SLURM_GPUS_ON_NODE": "x"}])
def test_gpu_without_gpus_in_the_step_says_what_to_do(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="--gpus-per-node"):
        resolve_nproc_per_node("gpu", environ)


@pytest.mark.parametrize("value", ["0", "-1", "two", "٣"])
def test_anything_else_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="a number of at least 1, or gpu"):
        resolve_nproc_per_node(value, {})
