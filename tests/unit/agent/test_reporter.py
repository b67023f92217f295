"""Batching, buffering and retry against a local HTTP server that fails, then recovers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from support.fake_controller import FakeController
from support.waiting import wait_for

from slurmft.agent.reporter import (
    MAX_RUN_BATCHES_PER_S,
    HttpTransport,
    ReportBuffer,
    Reporter,
    backoff_s,
    report_interval_s,
)
from slurmft.config import ConfigError
from slurmft.protocol import (
    MAX_BATCH_EVENTS,
    AgentEvent,
    AllocationMember,
    AllocationReport,
    Command,
    RankHeartbeat,
    RankStepTime,
)


@pytest.fixture
def controller() -> Iterator[FakeController]:
    """The stand-in daemon, its clock 5 s ahead (the clock check must see the skew)."""
    server = FakeController({"r1": "tok"}, clock_offset_s=5.0).start()
    yield server
    server.stop()


# Report times the daemon takes (a time before 2020 is refused as a broken clock).
T0 = 1_700_000_000.0


def heartbeat(rank: int, t: float) -> RankHeartbeat:
    return RankHeartbeat(rank, rank, "step", 1, 0.1, 300.0, False, t)


def event(n: int) -> AgentEvent:
    return AgentEvent("restart", T0 + n, f"event {n}")


# Short polls: the reporter sends every 0.05 s in these tests.
POLL_S = 0.02


def test_outage_keeps_the_batch_and_its_seq_until_acknowledged(controller: FakeController) -> None:
    controller.fail_first = 3
    commands: list[Command] = []
    # No keepalive batch in between (a slow machine can spend its 2 s on the retries), so the
    # sequence numbers below are the two batches' own.
    reporter = Reporter(
        HttpTransport(controller.url, "tok"),
        run_id="r1",
        node="n1",
        on_command=commands.append,
        interval_s=0.05,
        backoff_cap_s=0.2,
        keepalive_s=60,
    )
    reporter.add(heartbeat(0, T0 + 1))
    reporter.add_event(event(1))
    reporter.start()
    try:
        wait_for(lambda: len(controller.accepted) == 1, 10, "the first batch", interval_s=POLL_S)
        reporter.add(RankStepTime(0, 2, 0.1, 0.0, T0 + 2))
        wait_for(lambda: len(controller.accepted) == 2, 10, "the second batch", interval_s=POLL_S)
    finally:
        reporter.stop(flush_timeout_s=2)
    assert [b.seq for b in controller.attempts] == [1, 1, 1, 1, 2]  # resent unchanged
    assert len({b.to_json() for b in controller.attempts[:4]}) == 1
    first, second = controller.accepted
    assert first.events == (event(1),) and first.heartbeats == (heartbeat(0, T0 + 1),)
    assert second.step_times == (RankStepTime(0, 2, 0.1, 0.0, T0 + 2),)
    assert set(controller.tokens) == {"Bearer tok"}
    assert reporter.counters.send_failures == 3


def test_reply_commands_reach_the_agent(controller: FakeController) -> None:
    controller.order("n1", Command("leave", "node n1 cordoned"))
    commands: list[Command] = []
    reporter = Reporter(
        HttpTransport(controller.url, "tok"),
        run_id="r1",
        node="n1",
        on_command=commands.append,
        interval_s=0.05,
    )
    reporter.add_event(event(1))
    reporter.start()
    try:
        wait_for(lambda: commands, 10, "a command", interval_s=POLL_S)
    finally:
        reporter.stop(flush_timeout_s=1)
    assert commands == [Command("leave", "node n1 cordoned")]


def test_an_idle_agent_still_fetches_its_commands(controller: FakeController) -> None:
    """Nothing to report (a spare, frozen workers): empty batches every keepalive_s."""
    controller.order("n1", Command("restart_workers", "rank 1 silent"))
    commands: list[Command] = []
    reporter = Reporter(
        HttpTransport(controller.url, "tok"),
        run_id="r1",
        node="n1",
        on_command=commands.append,
        interval_s=0.05,
        keepalive_s=0.1,
    )
    reporter.start()
    try:
        wait_for(lambda: len(controller.accepted) >= 2, 10, "two batches", interval_s=POLL_S)
    finally:
        reporter.stop(flush_timeout_s=1)
    first = controller.accepted[0]
    assert (first.heartbeats, first.step_times, first.events) == ((), (), ())
    assert commands[0] == Command("restart_workers", "rank 1 silent")


def test_a_rejected_batch_is_dropped_not_retried_forever(controller: FakeController) -> None:
    reporter = Reporter(
        HttpTransport(controller.url, "wrong"),
        run_id="r1",
        node="n1",
        on_command=lambda c: None,
        interval_s=0.05,
    )
    reporter.add_event(event(1))
    assert reporter.send_once() is True
    assert reporter.counters.rejected_batches == 1 and reporter.pending() == 0


@pytest.mark.serial  # bounds a wait in seconds
def test_unreachable_controller_is_retryable_and_flush_is_bounded() -> None:
    transport = HttpTransport("http://127.0.0.1:9", "tok", timeout_s=0.5)  # discard port: refused
    reporter = Reporter(transport, run_id="r1", node="n1", on_command=lambda c: None)
    reporter.add_event(event(1))
    assert reporter.send_once() is False
    assert reporter.pending() == 1
    started = time.monotonic()
    reporter.start().stop(flush_timeout_s=0.5)
    assert time.monotonic() - started < 3


def test_buffer_drops_oldest_heartbeats_first_then_step_times_never_events() -> None:
    buffer = ReportBuffer(max_items=4)
    for n in range(3):
        buffer.add(event(n))
    buffer.add(RankStepTime(0, 1, 0.1, 0.0, 1.0))
    buffer.add(heartbeat(0, 1.0))
    buffer.add(heartbeat(0, 2.0))
    assert list(buffer.heartbeats) == [] and len(buffer.step_times) == 1
    buffer.add(RankStepTime(0, 2, 0.1, 0.0, 2.0))  # no heartbeat left: the oldest step goes
    assert [st.step for st in buffer.step_times] == [2]
    for n in range(3, 6):
        buffer.add(event(n))
    # Over the bound, and still every event is kept.
    assert len(buffer.events) == 6 and not buffer.step_times
    assert buffer.counters.dropped_heartbeats == 2 and buffer.counters.dropped_step_times == 2
    _, _, events = buffer.take(4)
    assert [e.message for e in events] == ["event 0", "event 1", "event 2", "event 3"]


def test_backoff_grows_to_its_cap() -> None:
    assert 0.4 <= backoff_s(1) <= 0.6
    assert 3.2 <= backoff_s(4) <= 4.8
    assert backoff_s(50, cap_s=30) <= 36
    # A daemon away for a day: about 3,000 failed sends at the cap, still a wait, not a crash.
    assert 24 <= backoff_s(3000, cap_s=30) <= 36


def test_server_time_for_the_clock_check(controller: FakeController) -> None:
    from slurmft.agent.clock import measure_skew

    skew = measure_skew(HttpTransport(controller.url, "tok").server_time)
    assert 4.5 < skew.offset_s < 5.5 and skew.too_large(1.0)


def test_a_batch_carries_at_most_the_events_the_daemon_takes_in_one() -> None:
    """Issue 14, item 10: the daemon refuses events past MAX_BATCH_EVENTS in one batch; the
    agent sends a backlog of events in several batches instead."""
    buffer = ReportBuffer(max_items=10)
    for n in range(MAX_BATCH_EVENTS + 5):
        buffer.add(event(n))
    _, _, events = buffer.take(5_000)
    assert len(events) == MAX_BATCH_EVENTS and len(buffer) == 5


def test_the_batch_steps_allocation_goes_at_once_and_alone(controller: FakeController) -> None:
    """The batch step's reporter sends its allocation as soon as it has one (no keep-alives in
    between: its batches are not an agent's), and the newest report wins over an unsent one."""
    first = AllocationReport("7", (AllocationMember("n1"), AllocationMember("n2")))
    newer = AllocationReport("7", (AllocationMember("n1"),))
    reporter = Reporter(
        HttpTransport(controller.url, "tok"),
        run_id="r1",
        node="n1",
        on_command=lambda _: None,
        interval_s=0.05,
        keepalive_s=float("inf"),
        agent_id="batch-step:7-abc",
    )
    reporter.report_allocation(first)
    reporter.report_allocation(newer)
    reporter.start()
    try:
        wait_for(lambda: controller.accepted, 10, "the allocation", interval_s=POLL_S)
    finally:
        reporter.stop(flush_timeout_s=1)
    (batch,) = controller.accepted
    assert (batch.agent_id, batch.allocation, batch.events) == ("batch-step:7-abc", newer, ())


@pytest.mark.parametrize(
    ("configured_s", "agents", "expected_s"),
    [(1.0, 4, 1.0), (1.0, 1024, 1.0), (1.0, 2048, 2.0), (1.0, 4096, 4.0), (5.0, 2048, 5.0),
     (0.5, 512, 0.5), (0.5, 1024, 1.0)],
)  # fmt: skip
def test_a_large_runs_agents_report_less_often_so_the_run_sends_a_bounded_rate(
    configured_s: float, agents: int, expected_s: float
) -> None:
    interval = report_interval_s(configured_s, agents)
    assert interval == pytest.approx(expected_s)
    assert agents / interval <= max(MAX_RUN_BATCHES_PER_S, agents / configured_s)


def test_a_controller_url_that_is_no_http_url_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"agent.controller_url 'login1:8787' is not http"):
        HttpTransport("login1:8787", "token")


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"SLURM_STEP_NUM_NODES": "2049", "SLURM_NNODES": "4000"}, 2049),  # the step's, spares in
        ({"SLURM_NNODES": "2049"}, 2049),  # an older srun: the job's count
        ({"SLURM_STEP_NUM_NODES": "", "SLURM_NNODES": "x"}, 2048),  # unreadable: the training nodes
        ({"SLURM_STEP_NUM_NODES": "0"}, 2048),
        ({}, 2048),
    ],
)
def test_the_agent_counts_its_steps_agents_from_slurm_else_the_training_nodes(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], expected: int
) -> None:
    from slurmft.cli.agent_cmd import _step_agents

    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert _step_agents(2048) == expected
