from __future__ import annotations

import traceback

import pytest

pytestmark = pytest.mark.torch


def test_which_errors_count_as_collective_failures() -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from slurmft.train.distributed import is_collective_error

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert is_collective_error(gloo)
    assert is_collective_error(dist.DistBackendError("NCCL communicator was aborted"))
    stack = traceback.StackSummary()
    assert is_collective_error(CheckpointException("save failed", {1: (gloo, stack)}))
    disk_full = (OSError("disk full"), stack)
    assert not is_collective_error(CheckpointException("save failed", {1: disk_full}))
    assert not is_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_error(ValueError("bad config"))
