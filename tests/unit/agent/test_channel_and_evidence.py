"""The agent's end of the rank channel, and stack dumps of a stuck process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.waiting import wait_for

from slurmft.agent.channel import RankChannelServer, RendezvousRound
from slurmft.agent.evidence import dump_stacks, is_stopped
from slurmft.protocol import AgentEvent, RankHeartbeat, RankStepTime
from slurmft.train.report import ReportChannel

IDENTITY = {
    "rank": 4,
    "local_rank": 1,
    "world_size": 8,
    "run_id": "r",
    "restart_count": 2,
    "pid": 777,
    "host": "n1",
}


def test_rank_messages_become_wire_records() -> None:
    path = str(Path(tempfile.mkdtemp(prefix="ch-")) / "ranks.sock")
    server = RankChannelServer(path)
    try:
        channel = ReportChannel(path, IDENTITY)
        channel.send(
            "heartbeat", phase="step", step=9, progress_age_s=0.5, deadline_s=300.0, overdue=False
        )
        channel.send("step", step=9, compute_s=0.2, wait_s=0.01, total_s=0.21)
        channel.send("event", event="collective_error", error="Connection reset by peer")
        channel.send("straggler", step=9, straggler_rank=6, group="all", ratio=1.5, window=10)
        channel.send("event", event="something_new")
        channel.send("event", event="checkpoint_saved", step=9)  # rank 4: rank 0 reports it
        server._sock.sendto(b"not json", path)
        got = server.drain()
    finally:
        server.close()
    heartbeat, step, failure, straggler = got
    assert isinstance(heartbeat, RankHeartbeat)
    assert (heartbeat.rank, heartbeat.local_rank, heartbeat.step, heartbeat.pid) == (4, 1, 9, 777)
    assert heartbeat.restart_count == 2 and not heartbeat.overdue
    assert isinstance(step, RankStepTime) and (step.step, step.compute_s) == (9, 0.2)
    assert isinstance(failure, AgentEvent) and failure.kind == "collective_error"
    assert failure.details["error"] == "Connection reset by peer"
    assert isinstance(straggler, AgentEvent) and straggler.kind == "straggler"
    assert straggler.rank == 6 and straggler.fault_class == "straggler"
    assert server.counters.ignored == {"something_new": 1, "checkpoint_saved": 1}
    assert server.counters.malformed == 1


def test_rounds_from_torchrun_and_a_workers_round_on_its_reports() -> None:
    path = str(Path(tempfile.mkdtemp(prefix="ch-")) / "ranks.sock")
    server = RankChannelServer(path)
    try:
        torchrun = ReportChannel(path, {"rank": 0, "rdzv_round": None})
        torchrun.send("round", round=0, previous=None)
        torchrun.send("round", round=3, previous=0)
        torchrun.send("round", round=True, previous=0)  # not a round number
        torchrun.send("round", round=4, previous=-1)
        worker = ReportChannel(path, {**IDENTITY, "rdzv_round": 3})
        worker.send("event", event="collective_error", error="Connection closed by peer")
        got = server.drain()
    finally:
        server.close()
    first, second, failure = got
    assert first == RendezvousRound(0, None, first.at)
    assert (second.round, second.previous) == (3, 0)  # type: ignore[union-attr]
    assert isinstance(failure, AgentEvent) and failure.details["rdzv_round"] == 3
    assert server.counters.malformed == 2


STUCK = """
import faulthandler, signal, sys, time
from pathlib import Path
stream = open(sys.argv[1], "a", buffering=1)
faulthandler.register(signal.SIGUSR2, file=stream, all_threads=True)
def stuck_in_a_collective():
    print("ready", flush=True)
    time.sleep(60)
stuck_in_a_collective()
"""


@pytest.mark.serial  # bounds a wait in seconds
@pytest.mark.parametrize("stopped", [False, True], ids=["stuck", "stopped"])
def test_stacks_of_a_stuck_process_are_collected(tmp_path: Path, stopped: bool) -> None:
    """A stopped process (SIGSTOP) cannot run its handler until continued: it dumps too."""
    path = tmp_path / "stacks-rank3-pid{}.txt"
    # The file name carries the pid: the child opens a file, which is renamed once its pid is known.
    child = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(tmp_path / "pending")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        (tmp_path / "pending").rename(Path(str(path).format(child.pid)))
        if stopped:
            os.kill(child.pid, signal.SIGSTOP)
            wait_for(lambda: is_stopped(child.pid), 10, "the child to stop", interval_s=0.01)
        # The child keeps writing to its open descriptor: the renamed file is its stack file.
        started = time.monotonic()
        (dump,) = dump_stacks({3: child.pid}, tmp_path, wait_s=5)
        assert time.monotonic() - started < 5
        assert dump.rank == 3 and dump.pid == child.pid
        assert "stuck_in_a_collective" in dump.text
        assert not is_stopped(child.pid)
    finally:
        child.kill()
        child.wait()
