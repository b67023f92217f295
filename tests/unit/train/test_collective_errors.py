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


FINISHED_RANK = """
import atexit, sys
from slurmft.train.distributed import exit_without_teardown

class Held:
    def __del__(self):
        print("destructor ran", flush=True)

def main():
    held = Held()  # as a Trainer holds its process group
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.stdout.write("last step logged")  # no newline, no flush: still in the buffer
    sys.stderr.write("summary on stderr")
    exit_without_teardown(7)

main()
"""


def test_a_finished_rank_exits_with_its_output_flushed_and_no_destructor_run() -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-c", FINISHED_RANK]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 7
    assert done.stdout == "last step logged"  # flushed; neither the destructor nor atexit ran
    assert done.stderr == "summary on stderr"
