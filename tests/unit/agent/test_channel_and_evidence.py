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

from slurmft.agent.channel import RankChannelServer, RendezvousRound, StoreHealth
from slurmft.agent.evidence import dump_stacks, is_stopped
from slurmft.protocol import AgentEvent, RankHeartbeat, RankStepTime
from slurmft.train.report import ReportChannel
from slurmft.train.stacks import DUMP_AND_EXIT_SIGNAL

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


def test_a_numerical_fault_is_numerical_when_reproduced_and_the_nodes_when_not() -> None:
    path = str(Path(tempfile.mkdtemp(prefix="ch-")) / "ranks.sock")
    server = RankChannelServer(path)
    try:
        channel = ReportChannel(path, IDENTITY)
        for reproduced in (True, False):
            channel.send("event", event="numerical_fault", step=28, reproduced=reproduced,
                         action="skip" if reproduced else "continue", samples=[7],
                         summary=f"the words {reproduced}")  # fmt: skip
        data, suspect = server.drain()
    finally:
        server.close()
    assert isinstance(data, AgentEvent) and isinstance(suspect, AgentEvent)
    assert (data.kind, data.fault_class, data.message) == (
        "numerical_fault", "numerical", "the words True"
    )
    assert (suspect.fault_class, suspect.rank) == ("hardware", 4)
    assert data.details["samples"] == [7] and data.details["action"] == "skip"


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


def test_the_launchers_word_on_the_store_reaches_the_agent_alone() -> None:
    path = str(Path(tempfile.mkdtemp(prefix="ch-")) / "ranks.sock")
    server = RankChannelServer(path)
    try:
        torchrun = ReportChannel(path, {"rank": 0, "rdzv_round": None})
        torchrun.send("store_failed", error="Connection reset by peer")
        torchrun.send("store_back")
        got = server.drain()
    finally:
        server.close()
    failed, back = got
    assert failed == StoreHealth(True, failed.at, "Connection reset by peer")  # type: ignore[union-attr]
    assert back == StoreHealth(False, back.at, "")  # type: ignore[union-attr]
    assert server.counters.malformed == 0


STUCK = """
import os, sys, threading, time
from pathlib import Path
from slurmft.train.stacks import install_stack_dump
install_stack_dump(3, directory=Path(sys.argv[1]))
def stuck_in_a_collective():
    print("ready", flush=True)
    while True:  # each pass says it ran: a stopped process continued for its dump must not
        time.sleep(0.001)
        os.write(1, b".")
threading.Thread(target=lambda: time.sleep(60), daemon=True).start()
stuck_in_a_collective()
"""


def _drain(stream: int) -> bytes:
    os.set_blocking(stream, False)
    try:
        return os.read(stream, 1 << 20)
    except BlockingIOError:
        return b""


@pytest.mark.serial  # bounds a wait in seconds
@pytest.mark.parametrize("stopped", [False, True], ids=["stuck", "stopped"])
def test_stacks_of_a_stuck_process_are_collected(tmp_path: Path, stopped: bool) -> None:
    """A stopped process (SIGSTOP) cannot run its handler until continued: it dumps too, and
    exits by the dump-and-exit signal without running on (else it could end one more step after
    its hang was declared)."""
    child = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        stdout = child.stdout.fileno()
        if stopped:
            os.kill(child.pid, signal.SIGSTOP)
            wait_for(lambda: is_stopped(child.pid), 10, "the child to stop", interval_s=0.01)
            _drain(stdout)
        started = time.monotonic()
        (dump,) = dump_stacks({3: child.pid}, tmp_path, wait_s=5)
        assert time.monotonic() - started < 5
        assert dump.rank == 3 and dump.pid == child.pid
        assert "stuck_in_a_collective" in dump.text and dump.text.count("Thread 0x") == 1
        if stopped:
            assert child.wait(timeout=10) == -DUMP_AND_EXIT_SIGNAL
            assert _drain(stdout) == b""  # not one pass of its loop after the stop
        else:
            time.sleep(0.05)
            assert child.poll() is None and _drain(stdout)  # dumped, and still running
    finally:
        child.kill()
        child.wait()
