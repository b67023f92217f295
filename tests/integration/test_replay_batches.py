"""Agent batches recorded from slurmft 0.1, replayed into this version's daemon.

A job started before an upgrade keeps its agents: they go on posting what 0.1 posts. The
recording (tests/fixtures/agent/batches-0.1.jsonl) is what a 0.1 agent set sent in the
`leave` test (tests/integration/agent/test_leave.py): four agents, three training and a spare,
one agent told to leave, the survivors' collective errors and restarts, the spare's
checkpoints. Each line is one request body as it came over the wire, only the keep-alives
without content left out. Replayed through the real HTTP ingest into a real store, in order:
every batch is acknowledged and stored once, but for 0.1's `node_lost` of its own leave (a kind
only the daemon records now: refused, the agent sends the rest again), and the daemon's budget
reads them as one free restart (the leave it ordered caused it) followed by progress.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import func, select
from support.daemon_side import count_and_record, post_batch

from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.controller.views import RecordRestarts
from slurmft.core.kinds import FaultClass
from slurmft.db import Database
from slurmft.db.models import ActionKind, ActionStatus, Event, StepTime
from slurmft.db.records import finish_action, plan_action

RECORDING = Path(__file__).parents[1] / "fixtures" / "agent" / "batches-0.1.jsonl"


def _recorded() -> list[bytes]:
    return [line for line in RECORDING.read_bytes().splitlines() if line]


def _replay(server: IngestServer, token: str) -> list[dict[str, object]]:
    """Each batch posted as the agent posts it: items refused (422) are dropped and the rest
    sent again under the same seq. Returns the refused items."""
    refused: list[dict[str, object]] = []
    for body in _recorded():
        status, reply = post_batch(server, body, token)
        if status == 422:
            batch = json.loads(body)
            for item in reply["refused"]:  # type: ignore[union-attr]
                refused.append(batch[item["items"]][item["index"]])
                batch[item["items"]][item["index"]] = None
            for items in ("heartbeats", "step_times", "events"):
                batch[items] = [x for x in batch[items] if x is not None]
            status, reply = post_batch(server, json.dumps(batch).encode(), token)
        assert status == 200, reply
        assert reply["acked_seq"] == json.loads(body)["seq"]
    return refused


def _the_leave_the_daemon_ordered(database: Database) -> None:
    """The daemon's own record of the `leave` it told the 0.1 agent: its agent_leave action,
    recorded as the replay ends (the daemon's times are its arrival times, as the agent's
    reports' are)."""
    with database.session() as s:
        row = plan_action(s, ActionKind.AGENT_LEAVE, "node cordoned for this run", run_id="t",
                          node="n1")  # fmt: skip
        finish_action(row, ActionStatus.DONE)


def test_batches_of_the_previous_version_are_stored_once_and_counted(
    database: Database, seed_run: Callable[..., None], ingest_server: IngestServer
) -> None:
    sent = [json.loads(body) for body in _recorded()]
    assert {b["v"] for b in sent} == {1} and {b["run_id"] for b in sent} == {"t"}
    token, digest = new_run_token()
    seed_run(database, "t", job_id="7", token_hash=digest)

    (refused,) = _replay(ingest_server, token)
    # resent whole (an agent that never saw the replies): stored once, refused again
    assert _replay(ingest_server, token) == [refused]

    kinds = collections.Counter(e["kind"] for b in sent for e in b["events"])
    assert kinds == {"checkpoint": 5, "collective_error": 2, "restart": 2, "node_lost": 1}
    # 0.1's agent said `node_lost` of its own leave: a kind only the daemon records now (its
    # agent's stop is `agent_stopped`). Refused, the rest of its batch is stored.
    assert refused["kind"] == "node_lost"
    del kinds["node_lost"]
    _the_leave_the_daemon_ordered(database)
    with database.session() as s:
        stored = collections.Counter(
            kind.value
            for kind in s.scalars(
                select(Event.kind).where(Event.run_id == "t", Event.source == "agent")
            )
        )
        steps = s.scalar(select(func.count()).select_from(StepTime).where(StepTime.run_id == "t"))
    assert stored == kinds
    assert steps == sum(len(b["step_times"]) for b in sent)

    budget, actions = count_and_record(database, "t")
    # One restart: every report names rendezvous round "/0", and the agent the daemon told to
    # leave caused it, so it is free; the spare's checkpoints after it are progress.
    assert budget.restarts_without_progress == 0
    (record,) = actions
    assert isinstance(record, RecordRestarts)
    assert [(r.key, r.cause, r.node_removed) for r in record.restarts] == [
        ("/0", FaultClass.HARDWARE, True)
    ]
    assert count_and_record(database, "t")[1] == []  # all of it recorded: nothing more to do
