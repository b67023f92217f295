"""Agent batches recorded from slurmft 0.1, replayed into this version's daemon.

A job started before an upgrade keeps its agents: they go on posting what 0.1 posts. The
recording (tests/fixtures/agent/batches-0.1.jsonl) is what a 0.1 agent set sent in the
`leave` test (tests/integration/agent/test_leave.py): four agents, three training and a spare,
one agent told to leave, the survivors' collective errors and restarts, the spare's
checkpoints. Each line is one request body as it came over the wire, only the keep-alives
without content left out. Replayed through the real HTTP ingest into a real store, in order:
every batch is acknowledged and stored once, and the daemon's budget reads them as one free
restart (the node that left caused it) followed by progress.
"""

from __future__ import annotations

import collections
import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from slurmft.controller.act import Executor
from slurmft.controller.decide import count_restarts
from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.controller.restarts import restart_evidence
from slurmft.controller.views import RecordRestarts, RunView
from slurmft.core.budget import RestartBudget
from slurmft.core.kinds import FaultClass
from slurmft.db import Database
from slurmft.db.models import Event, Run, StepTime
from slurmft.protocol import BATCH_PATH

RECORDING = Path(__file__).parents[1] / "fixtures" / "agent" / "batches-0.1.jsonl"


def _recorded() -> list[bytes]:
    return [line for line in RECORDING.read_bytes().splitlines() if line]


@pytest.fixture
def server(database: Database) -> Iterator[IngestServer]:
    srv = IngestServer(database).start()
    try:
        yield srv
    finally:
        srv.stop()


def _post(server: IngestServer, body: bytes, token: str) -> tuple[int, dict[str, object]]:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(
            "POST",
            BATCH_PATH,
            body=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _replay(server: IngestServer, token: str) -> None:
    for body in _recorded():
        status, reply = _post(server, body, token)
        assert status == 200, reply
        assert reply["acked_seq"] == json.loads(body)["seq"]


def test_batches_of_the_previous_version_are_stored_once_and_counted(
    database: Database, seed_run: Callable[..., None], server: IngestServer
) -> None:
    sent = [json.loads(body) for body in _recorded()]
    assert {b["v"] for b in sent} == {1} and {b["run_id"] for b in sent} == {"t"}
    token, digest = new_run_token()
    seed_run(database, "t", job_id="7", token_hash=digest)

    _replay(server, token)
    _replay(server, token)  # resent whole (an agent that never saw the replies): stored once

    kinds = collections.Counter(e["kind"] for b in sent for e in b["events"])
    assert kinds == {"checkpoint": 5, "collective_error": 2, "restart": 2, "node_lost": 1}
    with database.session() as s:
        stored = collections.Counter(
            kind.value
            for kind in s.scalars(
                select(Event.kind).where(Event.run_id == "t", Event.source == "agent")
            )
        )
        steps = s.scalar(select(func.count()).select_from(StepTime).where(StepTime.run_id == "t"))
        run = s.get(Run, "t")
        assert run is not None
        view = RunView(
            "t",
            3,
            None,
            budget=RestartBudget(restarts_without_progress=run.restarts_without_progress),
            restarts=restart_evidence(s, run),
        )
    assert stored == kinds
    assert steps == sum(len(b["step_times"]) for b in sent)

    budget, actions = count_restarts(view, cap=5)
    # One restart: every report names rendezvous round "/0", and the agent that left (its
    # node_lost) caused it, so it is free; the spare's checkpoints after it are progress.
    assert budget.restarts_without_progress == 0
    (record,) = actions
    assert isinstance(record, RecordRestarts)
    assert [(r.key, r.cause, r.node_removed) for r in record.restarts] == [
        ("/0", FaultClass.HARDWARE, True)
    ]
    Executor(database, slurm=None).execute(actions)  # type: ignore[arg-type]  # records only
    with database.session() as s:
        run = s.get(Run, "t")
        assert run is not None
        view = RunView("t", 3, None, restarts=restart_evidence(s, run))
    assert count_restarts(view, cap=5)[1] == []  # all of it recorded: nothing more to do
