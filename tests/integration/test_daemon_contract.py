"""The daemon as the agent sees it: the same assertions against the agent tests' stand-in
(support.fake_controller) and against the real daemon's ingest endpoint on a SQLite store, so
that the agent tests run against a daemon that answers as the real one does.

Each test talks through the agent's own client (HttpTransport, Reporter): what is asserted is
what an agent gets back, and what the daemon kept of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

import msgspec
import pytest
from sqlalchemy import select
from support.fake_controller import FakeController
from support.waiting import wait_for

from slurmft.agent.clock import measure_skew
from slurmft.agent.reporter import HttpTransport, RejectedError, Reporter
from slurmft.controller import views as v
from slurmft.controller.act import Executor
from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.db import Database
from slurmft.db.models import Event
from slurmft.db.records import denylist_add
from slurmft.protocol import AgentBatch, AgentEvent, Command, CommandKind

RUN = "r1"
SKEW_S = 5.0  # both counterparts run their clock this far ahead of the agent's
SENT_AT = 1_700_000_000.0


class Counterpart(Protocol):
    """What the agent talks to, and how a test arranges and reads the daemon's side."""

    url: str
    token: str  # the run's token, as the agent is given it

    def order(self, node: str, command: Command) -> None:
        """Decide ``command`` for ``node`` as the daemon would."""

    def stored(self) -> list[str]:
        """The messages of the agent events the daemon kept, in the order they came."""


class Fake:
    """The agent tests' stand-in (support.fake_controller)."""

    def __init__(self) -> None:
        self.token = "run-token"
        self.controller = FakeController({RUN: self.token}, clock_offset_s=SKEW_S).start()
        self.url = self.controller.url

    def order(self, node: str, command: Command) -> None:
        self.controller.order(node, command)

    def stored(self) -> list[str]:
        return [event.message for batch in self.controller.received() for event in batch.events]


class Daemon:
    """The daemon's own ingest endpoint (IngestServer) over a store holding the run."""

    def __init__(self, database: Database, token: str) -> None:
        self.database, self.token = database, token
        self.server = IngestServer(database, clock=_skewed_clock).start()
        self.url = self.server.url

    def order(self, node: str, command: Command) -> None:
        if command.kind is CommandKind.LEAVE:  # the node is kept out of the run
            with self.database.session() as session:
                denylist_add(session, node, command.reason, run_id=RUN)
            return
        restart = v.RestartWorkers(RUN, command.reason, node=node)
        Executor(self.database, slurm=None).execute([restart])  # type: ignore[arg-type]

    def stored(self) -> list[str]:
        with self.database.session() as session:
            kept = select(Event.message).where(Event.source == "agent").order_by(Event.id)
            return list(session.scalars(kept))


def _skewed_clock() -> datetime:
    return datetime.now(UTC) + timedelta(seconds=SKEW_S)


@pytest.fixture(params=["fake", "daemon"])
def counterpart(
    request: pytest.FixtureRequest, tmp_path: Path, seed_run: Callable[..., None]
) -> Iterator[Counterpart]:
    if request.param == "fake":
        fake = Fake()
        try:
            yield fake
        finally:
            fake.controller.stop()
        return
    database = Database(f"sqlite:///{tmp_path / 'slurmft.db'}")
    database.upgrade()
    token, digest = new_run_token()
    seed_run(database, RUN, job_id="7", token_hash=digest)
    real = Daemon(database, token)
    try:
        yield real
    finally:
        real.server.stop()
        database.dispose()


@dataclass
class Agent:
    """The batches of one agent on ``node``, numbered as an agent numbers them."""

    node: str
    seq: int = 0

    def batch(self, message: str) -> AgentBatch:
        """The agent's next batch, holding one event with ``message``."""
        self.seq += 1
        event = AgentEvent("restart", SENT_AT, message)
        return AgentBatch(run_id=RUN, agent_id=f"{self.node}-a1", node=self.node, seq=self.seq,
                          sent_at=SENT_AT, events=(event,))  # fmt: skip


def test_a_batch_is_acknowledged_by_its_seq_and_stored(counterpart: Counterpart) -> None:
    transport, agent = HttpTransport(counterpart.url, counterpart.token), Agent("n1")
    for message in ("event 1", "event 2"):
        batch = agent.batch(message)
        reply = transport.send_batch(batch)
        assert reply.acked_seq == batch.seq and reply.commands == ()
    assert counterpart.stored() == ["event 1", "event 2"]


def test_a_resent_batch_is_acknowledged_again_and_stored_once(counterpart: Counterpart) -> None:
    transport, agent = HttpTransport(counterpart.url, counterpart.token), Agent("n1")
    first = agent.batch("event 1")
    assert [transport.send_batch(first).acked_seq for _ in range(3)] == [1, 1, 1]
    assert transport.send_batch(agent.batch("event 2")).acked_seq == 2
    assert transport.send_batch(first).acked_seq == 1  # a late resend, after a newer batch
    assert counterpart.stored() == ["event 1", "event 2"]


@pytest.mark.parametrize(
    ("token", "run_id", "status"),
    [("", RUN, 401), ("not-the-token", RUN, 401), (None, "another-run", 403)],
    ids=["no token", "wrong token", "another run"],
)
def test_a_batch_without_its_runs_token_is_refused_and_dropped(
    counterpart: Counterpart, token: str | None, run_id: str, status: int
) -> None:
    transport = HttpTransport(counterpart.url, counterpart.token if token is None else token)
    batch = msgspec.structs.replace(Agent("n1").batch("event 1"), run_id=run_id)
    with pytest.raises(RejectedError, match=f"HTTP {status}"):
        transport.send_batch(batch)
    # The reporter drops a refused batch: resending it could never help.
    reporter = Reporter(transport, run_id=run_id, node="n1", on_command=lambda c: None)
    reporter.add_event(batch.events[0])
    assert reporter.send_once() is True
    assert reporter.counters.rejected_batches == 1 and reporter.pending() == 0
    assert counterpart.stored() == []


def test_the_time_endpoint_answers_the_daemons_clock(counterpart: Counterpart) -> None:
    skew = measure_skew(HttpTransport(counterpart.url, counterpart.token).server_time)
    assert SKEW_S - 0.5 < skew.offset_s < SKEW_S + 0.5


def test_leave_comes_with_every_reply_while_it_stands_and_a_restart_once(
    counterpart: Counterpart,
) -> None:
    leave = Command(CommandKind.LEAVE, "slurmft: Xid 79 GPU fell off the bus (GPU 3)")
    restart = Command(CommandKind.RESTART_WORKERS, "slurmft: hang rank 7")
    counterpart.order("n2", leave)
    counterpart.order("n3", restart)
    transport = HttpTransport(counterpart.url, counterpart.token)
    n1, n2, n3 = Agent("n1"), Agent("n2"), Agent("n3")
    replies = [transport.send_batch(a.batch(f"{a.node} {i}")) for i in (1, 2) for a in (n1, n2, n3)]
    assert [r.commands for r in replies] == [(), (leave,), (restart,), (), (leave,), ()]


def test_the_reporter_hands_each_command_to_the_agent(counterpart: Counterpart) -> None:
    leave = Command(CommandKind.LEAVE, "node n1 cordoned")
    counterpart.order("n1", leave)
    commands: list[Command] = []
    reporter = Reporter(HttpTransport(counterpart.url, counterpart.token), run_id=RUN, node="n1",
                        on_command=commands.append, interval_s=0.05)  # fmt: skip
    reporter.add_event(AgentEvent("restart", SENT_AT, "event 1"))
    reporter.start()
    try:
        wait_for(lambda: commands, 10, "the leave command", interval_s=0.02)
    finally:
        reporter.stop(flush_timeout_s=1)
    assert commands[0] == leave
    assert counterpart.stored() == ["event 1"]


def test_a_bad_event_is_refused_alone_and_the_good_items_beside_it_are_stored(
    counterpart: Counterpart,
) -> None:
    """Issue 14, item 16: an impossible value (an event time of 1e20) with a valid token is
    refused with a 4xx naming the item, never a 500 the agent would retry for ever; the agent
    drops that event alone and sends the rest of its batch again."""
    reporter = Reporter(HttpTransport(counterpart.url, counterpart.token), run_id=RUN, node="n1",
                        on_command=lambda c: None)  # fmt: skip
    reporter.add(AgentEvent("restart", SENT_AT, "event 1"))
    reporter.add(AgentEvent("restart", 1e20, "event from the far future"))
    reporter.add(AgentEvent("restart", SENT_AT, "event 2"))
    assert reporter.send_once() is True  # delivered: nothing left in flight, nothing retried
    assert reporter.pending() == 0
    assert (reporter.counters.refused_items, reporter.counters.rejected_batches) == (1, 0)
    assert counterpart.stored() == ["event 1", "event 2"]
