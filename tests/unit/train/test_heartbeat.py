from __future__ import annotations

import socket
from pathlib import Path

import pytest

from slurmft.train.heartbeat import Heartbeat, Phase, is_overdue
from slurmft.train.report import ReportChannel, decode


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def silent_channel() -> ReportChannel:
    return ReportChannel(socket_path="", identity={"rank": 0})


def test_a_long_checkpoint_is_reported_as_checkpointing_within_its_own_deadline() -> None:
    clock = FakeClock()
    heartbeat = Heartbeat(
        silent_channel(), deadlines_s={Phase.STEP: 10, Phase.CHECKPOINT: 600}, clock=clock
    )
    heartbeat.enter(Phase.STEP, 4)
    with heartbeat.phase(Phase.CHECKPOINT, 5):
        clock.now += 120  # twelve step deadlines
        message = heartbeat.message()
        assert (message["phase"], message["step"], message["progress_age_s"]) == (
            "checkpoint",
            5,
            120.0,
        )
        assert not is_overdue(message)
    assert heartbeat.current_phase is Phase.STEP


def test_a_step_without_progress_past_its_deadline_is_overdue() -> None:
    clock = FakeClock()
    heartbeat = Heartbeat(silent_channel(), deadlines_s={Phase.STEP: 10}, clock=clock)
    heartbeat.enter(Phase.STEP, 0)
    for step in range(1, 6):
        clock.now += 9
        heartbeat.progress(step)
    assert not is_overdue(heartbeat.message())
    clock.now += 11
    assert is_overdue(heartbeat.message())


def test_the_thread_sends_periodically_to_the_agent(tmp_path: Path) -> None:
    path = str(tmp_path / "agent.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(10)  # a starved machine delays the thread; it never silences it
    heartbeat = Heartbeat(ReportChannel(path, {"rank": 1}), interval_s=0.05).start()
    try:
        messages = [decode(receiver.recv(65536)) for _ in range(3)]  # about 0.1 s when idle
    finally:
        heartbeat.stop()
    receiver.setblocking(False)
    while True:
        try:
            messages.append(decode(receiver.recv(65536)))
        except BlockingIOError:
            break
    receiver.close()
    assert len(messages) >= 4  # three periodic ones (waited for), then stop()'s
    assert {m["kind"] for m in messages} == {"heartbeat"}
    assert [m["phase"] for m in messages][-1] == "done"  # stop() says so
    assert {m["phase"] for m in messages[:-1]} == {"init"}


@pytest.mark.torch
def test_a_collective_error_leaves_the_rank_marked_as_waiting() -> None:
    from slurmft.train.timing import StepTimer

    heartbeat = Heartbeat(silent_channel())
    timer = StepTimer(heartbeat=heartbeat)
    timer.start_step(1)
    with timer.compute():
        assert heartbeat.message()["section"] == "compute"
    assert heartbeat.message()["section"] is None
    with pytest.raises(RuntimeError), timer.wait():
        raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    # Sent while the process exits: still a victim inside the collective, not a suspect.
    assert heartbeat.message()["section"] == "wait"
