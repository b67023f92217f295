"""The daemon's agent endpoint over real HTTP into a real store (SQLite and PostgreSQL)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from support.daemon_side import post_batch, post_raw, store_state

from slurmft.controller import views as v
from slurmft.controller.act import Executor
from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import RESTART_COMMAND_TTL, new_run_token
from slurmft.db import Database
from slurmft.db.models import (
    Action,
    ActionStatus,
    Event,
    RankHeartbeat,
    StepTime,
)
from slurmft.db.records import EXPIRED, denylist_add, denylist_remove
from slurmft.protocol import (
    MAX_BATCH_EVENTS,
    MAX_BODY_BYTES,
    TIME_PATH,
    AgentBatch,
    AgentEvent,
    BatchReply,
    RankStepTime,
)
from slurmft.protocol import (
    RankHeartbeat as WireHeartbeat,
)

NOW = time.time()


@pytest.fixture
def tokens(database: Database, seed_run: Callable[..., None]) -> dict[str, str]:
    out = {}
    for run_id in ("r1", "r2"):
        token, digest = new_run_token()
        seed_run(database, run_id, job_id="7" if run_id == "r1" else None, token_hash=digest)
        out[run_id] = token
    return out


@pytest.fixture
def server(ingest_server: IngestServer) -> IngestServer:
    return ingest_server


def _batch(
    seq: int = 1,
    run_id: str = "r1",
    node: str = "n2",
    agent: str = "a-n2-1",
    ranks: range = range(3, 6),
) -> AgentBatch:
    return AgentBatch(
        run_id=run_id,
        agent_id=agent,
        node=node,
        seq=seq,
        sent_at=NOW + seq,
        heartbeats=tuple(
            WireHeartbeat(
                rank=r,
                local_rank=r - 3,
                phase="step",
                step=10 * seq,
                progress_age_s=0.5,
                deadline_s=300.0,
                overdue=False,
                sent_at=NOW + seq,
            )
            for r in ranks
        ),
        step_times=tuple(
            RankStepTime(rank=r, step=10 * seq, compute_s=0.2, wait_s=0.05, ended_at=NOW + seq)
            for r in ranks
        ),
        events=(
            AgentEvent(
                kind="restart",
                occurred_at=NOW + seq,
                message="workers restarted",
                fault_class="hardware",
            ),
        ),
    )


def _count(database: Database, model: type) -> int:
    with database.session() as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def test_a_batch_is_stored_once_however_often_it_is_sent(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    for _ in range(3):
        status, data = post_batch(server, _batch(seq=1).to_json(), tokens["r1"])
        assert status == 200
        reply = BatchReply.from_json(json.dumps({"v": 1, **data}))
        assert reply.acked_seq == 1 and reply.commands == ()
    assert (
        _count(database, RankHeartbeat),
        _count(database, StepTime),
        _count(database, Event),
    ) == (3, 3, 1)
    assert post_batch(server, _batch(seq=2).to_json(), tokens["r1"])[0] == 200
    assert (_count(database, StepTime), _count(database, Event)) == (6, 2)
    with database.session() as s:
        hb = s.get(RankHeartbeat, ("r1", 4))
        assert hb is not None and (hb.step, hb.node, hb.deadline_s) == (20, "n2", 300.0)
        event = s.scalars(select(Event)).first()
        assert event is not None and (event.source, event.node, event.attempt_id) == (
            "agent",
            "n2",
            1,
        )


@pytest.mark.parametrize(
    ("token_for", "status"),
    [(None, 401), ("wrong", 401), ("r2", 403)],
    ids=["no token", "wrong token", "another run's token"],
)
def test_a_batch_without_its_run_token_is_refused(
    database: Database,
    server: IngestServer,
    tokens: dict[str, str],
    token_for: str | None,
    status: int,
) -> None:
    token = None if token_for is None else tokens.get(token_for, "not-a-token")
    got, data = post_batch(server, _batch().to_json(), token)
    assert got == status and "error" in data
    assert _count(database, StepTime) == 0


def test_oversized_and_malformed_payloads_are_refused_and_the_server_stays_up(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    status, data = post_batch(
        server, b"x", tokens["r1"], headers={"Content-Length": str(MAX_BODY_BYTES + 1)}
    )
    assert status == 413
    status, data = post_batch(server, b'{"v": 1, "run_id": "r1"}', tokens["r1"])
    assert status == 400 and "missing" in str(data["error"])
    status, data = post_batch(server, b"\xff\xfe not json", tokens["r1"])
    assert status == 400
    assert post_batch(server, _batch().to_json(), tokens["r1"])[0] == 200


def test_the_reply_tells_an_excluded_node_to_leave_and_a_hung_one_to_restart(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    Executor(database, slurm=None).execute(
        [  # type: ignore[arg-type]
            v.ExcludeNode("r1", "slurmft: Xid 79 GPU has fallen off the bus (GPU 3)", node="n2"),
            v.RestartWorkers("r1", "slurmft: hang rank 7", node="n3"),
        ]
    )
    _, data = post_batch(server, _batch(node="n2").to_json(), tokens["r1"])
    assert data["commands"] == [
        {"kind": "leave", "reason": "slurmft: Xid 79 GPU has fallen off the bus (GPU 3)"}
    ]
    _, data = post_batch(server, _batch(node="n3", agent="a-n3-1").to_json(), tokens["r1"])
    assert data["commands"] == [{"kind": "restart_workers", "reason": "slurmft: hang rank 7"}]
    _, data = post_batch(server, _batch(seq=2, node="n3", agent="a-n3-1").to_json(), tokens["r1"])
    assert data["commands"] == []  # delivered once
    with database.session() as s:
        statuses = s.scalars(select(Action.status).order_by(Action.id)).all()
    assert statuses == [ActionStatus.DONE, ActionStatus.DONE]


def test_only_an_active_exclusion_of_this_run_or_of_every_run_makes_a_node_leave(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    with database.session() as s:
        denylist_add(s, "n1", "slurmft: slow in r2", run_id="r2")  # another run's
        denylist_add(s, "n2", "lent back", expires_at=datetime.now(UTC) - timedelta(minutes=1))
        denylist_add(s, "n3", "slurmft: drained")  # every run's
        denylist_add(s, "n4", "slurmft: flaky in r1", run_id="r1")
        denylist_remove(s, "n4", run_id="r1")  # ended by an operator
    for node in ("n1", "n2", "n3", "n4"):
        _, data = post_batch(server, _batch(node=node, agent=f"a-{node}").to_json(), tokens["r1"])
        expected = [{"kind": "leave", "reason": "slurmft: drained"}] if node == "n3" else []
        assert data["commands"] == expected, node


def test_the_stacks_saved_for_a_commanded_restart_become_its_evidence(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    reason = "slurmft: hang rank 4 silent for 6s while peers report"
    Executor(database, slurm=None).execute(
        [v.RestartWorkers("r1", reason, node="n3")]  # type: ignore[arg-type]
    )
    _, data = post_batch(server, _batch(node="n3", agent="a-n3-1").to_json(), tokens["r1"])
    assert data["commands"] == [{"kind": "restart_workers", "reason": reason}]
    stacks = {"4": 'File "tiny.py", line 290 in train_step'}
    hang = AgentEvent(
        kind="hang",
        occurred_at=NOW,
        message=f"controller: {reason}: stacks saved, killing 1 worker(s)",
        rank=4,
        fault_class="hang",
        details={"stacks": stacks, "stack_files": {"4": "/tmp/s/stacks-rank4-pid9.txt"}},
    )
    own = msgspec.structs.replace(hang, message="rank 4 stuck in step for 400 s: stacks saved")
    for seq, event in ((2, own), (3, hang)):
        batch = msgspec.structs.replace(_batch(seq, node="n3", agent="a-n3-1"), events=(event,))
        assert post_batch(server, batch.to_json(), tokens["r1"])[0] == 200
    with database.session() as s:
        action = s.scalars(select(Action)).one()
        event = s.get(Event, action.event_id)
        assert event is not None and event.message == hang.message  # not the agent's own hang
        assert action.evidence["stacks"] == stacks
        assert action.evidence["stacks_event_id"] == event.id


def test_time_endpoint_for_the_clock_skew_check(server: IngestServer) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", TIME_PATH)
    data = json.loads(conn.getresponse().read())
    assert abs(data["server_time"] - datetime.now(UTC).timestamp()) < 5


def _containers(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=10), children, max_size=4),
    )


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    _containers,
    max_leaves=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.one_of(
        st.binary(max_size=300),
        _json_values.map(lambda value: json.dumps(value).encode()),
        st.dictionaries(
            st.sampled_from(
                [
                    "v",
                    "run_id",
                    "agent_id",
                    "node",
                    "seq",
                    "sent_at",
                    "heartbeats",
                    "step_times",
                    "events",
                ]
            ),
            _json_values,
        ).map(lambda d: json.dumps({"v": 1, **d}).encode()),
    )
)
def test_garbage_never_gets_past_validation(
    database: Database, server: IngestServer, tokens: dict[str, str], body: bytes
) -> None:
    status, data = post_batch(server, body, tokens["r1"])
    assert status in {400, 403, 422}, data
    assert _count(database, StepTime) == 0


def test_a_gpu_fault_from_an_agent_keeps_its_xid_gpu_and_action(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    fault = AgentEvent(
        kind="gpu_fault",
        occurred_at=NOW,
        message="Xid 79 GPU has fallen off the bus (GPU 3)",
        fault_class="hardware",
        details={"xid": 79, "gpu_index": 3, "action": "drain"},
    )
    batch = msgspec.structs.replace(_batch(), events=(fault,))
    assert post_batch(server, batch.to_json(), tokens["r1"])[0] == 200
    with database.session() as s:
        event = s.scalars(select(Event)).one()
        assert (event.kind.value, event.xid, event.gpu_index, event.node) == (
            "gpu_fault",
            79,
            3,
            "n2",
        )
        assert event.details["action"] == "drain"


def test_a_planned_worker_restart_expires_and_is_never_delivered_late(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    """Issue 14, item 12: a restart decided for a node whose agent did not report for minutes
    answers a hang long gone; it expires instead of restarting a healthy run later."""
    executor = Executor(database, slurm=None)  # type: ignore[arg-type]
    executor.execute(
        [
            v.RestartWorkers("r1", "slurmft: hang rank 7", node="n3"),
            v.RestartWorkers("r1", "slurmft: hang rank 1", node="n2"),
        ]
    )
    with database.session() as s:  # the first was decided ten minutes ago
        old = s.scalars(select(Action).where(Action.node == "n3")).one()
        old.created_at = datetime.now(UTC) - timedelta(minutes=10)
    _, data = post_batch(server, _batch(node="n3", agent="a-n3-1").to_json(), tokens["r1"])
    assert data["commands"] == []  # never delivered late, even before a pass expires it
    assert executor.expire_commands(datetime.now(UTC), RESTART_COMMAND_TTL) == 1
    _, data = post_batch(server, _batch(node="n2").to_json(), tokens["r1"])
    assert data["commands"] == [{"kind": "restart_workers", "reason": "slurmft: hang rank 1"}]
    with database.session() as s:
        rows = s.scalars(select(Action).order_by(Action.id)).all()
        assert [(a.node, a.status, a.error) for a in rows] == [
            ("n3", ActionStatus.SKIPPED, EXPIRED),
            ("n2", ActionStatus.DONE, None),
        ]
    assert EXPIRED.startswith("expired")


def _body(seq: int = 1, **changes: object) -> dict[str, object]:
    data: dict[str, object] = json.loads(_batch(seq).to_json())
    data.update(changes)
    return data


def _nested(depth: int) -> str:
    return '{"a":' * depth + "{}" + "}" * depth


def _with_details(details_json: str) -> bytes:
    """The batch with its event's details as this JSON text (too deep for json.dumps)."""
    body = json.dumps(_body(events=[{"kind": "restart", "occurred_at": NOW, "details": {}}]))
    return body.replace('"details": {}', f'"details": {details_json}').encode()


_HB = json.loads(_batch().to_json())["heartbeats"][0]
_EVENT = json.loads(_batch().to_json())["events"][0]

# Issue 14, item 16: each once answered 500 (the agent retries that for ever), or was stored.
IMPOSSIBLE = {
    "event time 1e20": (_body(events=[{**_EVENT, "occurred_at": 1e20}]), 422),
    "event time a week ahead": (_body(events=[{**_EVENT, "occurred_at": NOW + 7 * 86400}]), 422),
    "rank 2**63": (_body(heartbeats=[{**_HB, "rank": 2**63}]), 422),
    "step past int32": (
        _body(
            step_times=[
                {"rank": 3, "step": 2**31, "compute_s": 0.2, "wait_s": 0.0, "ended_at": NOW}
            ]
        ),
        422,
    ),
    "sequence 2**63": (_body(seq=2**63), 400),
    "sequence 2**63-1": (_body(seq=2**63 - 1), 400),  # accepted, it froze the agent's cursor
    "batch time 1e20": (_body(sent_at=1e20), 400),
    "NUL in the node": (_body(node="n\u00002"), 400),
    "NUL in a message": (_body(events=[{**_EVENT, "message": "a\u0000b"}]), 422),
    "NUL in details": (_body(events=[{**_EVENT, "details": {"k": "\u0000"}}]), 422),
    "Xid past int32": (_body(events=[{**_EVENT, "details": {"xid": 2**40}}]), 422),
    "a node name of 200 characters": (_body(node="n" * 200), 400),
    "details nested 100 deep": (_with_details(_nested(100)), 422),
    "details nested 5,000 deep": (_with_details(_nested(5000)), 400),
}


@pytest.mark.parametrize(("body", "status"), IMPOSSIBLE.values(), ids=IMPOSSIBLE.keys())
def test_impossible_values_with_a_valid_token_are_refused_with_a_4xx_not_a_500(
    database: Database,
    server: IngestServer,
    tokens: dict[str, str],
    body: dict[str, object] | bytes,
    status: int,
) -> None:
    """Nothing of a refused batch is stored, no cursor moves, and the agent's next batches are
    stored as before (a cursor can never be pushed where every later batch reads as a resend)."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = store_state(database)
    got, reply = post_batch(server, payload, tokens["r1"])
    assert got == status, reply
    if status == 422:  # the items are named, so the agent can drop exactly them
        assert reply["refused"] and {"items", "index", "reason"} <= set(reply["refused"][0])
    assert store_state(database) == before
    for seq in (1, 2):
        assert post_batch(server, _batch(seq).to_json(), tokens["r1"]) == (
            200,
            {
                "acked_seq": seq,
                "server_time": pytest.approx(time.time(), abs=60),
                "commands": [],
                "v": 1,
            },
        )
    assert _count(database, StepTime) == 6


def test_a_content_length_that_is_not_ascii_digits_is_refused_not_a_500(
    server: IngestServer, tokens: dict[str, str]
) -> None:
    """Issue 14, item 16: "²" passes str.isdigit() and then fails int()."""
    request = (
        f"POST /v1/agent/batch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tokens['r1']}"
        "\r\nContent-Type: application/json\r\nContent-Length: ²\r\n\r\n{}"
    ).encode("latin-1")  # as http.server reads headers
    status, body = post_raw(server, request)
    assert status == 400 and b"is not a byte count" in body, body


def test_twenty_thousand_events_in_one_batch_are_capped_and_the_excess_refused(
    database: Database, server: IngestServer, tokens: dict[str, str]
) -> None:
    """Issue 14, item 10: 20,000 events in one batch must not become 20,000 actions: past
    MAX_BATCH_EVENTS each is refused by name, and nothing of the batch is stored."""
    events = [{**_EVENT, "message": f"event {i}"} for i in range(20_000)]
    body = _body(heartbeats=[], step_times=[], events=events)
    status, reply = post_batch(server, json.dumps(body).encode(), tokens["r1"])
    assert status == 422, reply
    refused = reply["refused"]
    assert isinstance(refused, list) and len(refused) == 20_000 - MAX_BATCH_EVENTS
    assert {(r["items"], r["index"]) for r in refused} == {
        ("events", i) for i in range(MAX_BATCH_EVENTS, 20_000)
    }
    assert "over the 1000 events of one batch" in refused[0]["reason"]
    assert _count(database, Event) == 0
    kept = {**body, "events": events[:MAX_BATCH_EVENTS]}  # what the agent sends again
    assert post_batch(server, json.dumps(kept).encode(), tokens["r1"])[0] == 200
    assert _count(database, Event) == MAX_BATCH_EVENTS
