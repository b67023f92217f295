"""Issue 14, item 10: quotas and rate limits, each refusal answered clearly, counted on
/metrics and recorded as an action that names the user (at most once a minute)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import select

from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.controller.limits import RateLimits
from slurmft.controller.metrics import DaemonMetrics
from slurmft.controller.rpc import RpcError
from slurmft.controller.user_ops import RunQuota, operations
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Run
from slurmft.db.states import RunState
from slurmft.protocol import BATCH_PATH, AgentBatch, AgentEvent

ALICE, BOB = 15001, 15002  # no passwd entries: their user names read as the uids


def _refusals(database: Database) -> list[Action]:
    with database.session() as s:
        return list(s.scalars(select(Action).where(Action.kind == ActionKind.REFUSE_REQUEST)))


def _refused(metrics: DaemonMetrics, limit: str) -> float:
    value = metrics.registry.get_sample_value("slurmft_refusals_total", {"limit": limit})
    return value or 0.0


SPEC = {"name": "train", "nodes": 2, "script": ["train.py"], "ckpt_dir": "/ckpt/train"}


def test_a_user_past_the_run_quota_is_refused_naming_it_counted_and_recorded(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "a-running", owner_uid=ALICE, owner_name="15001")
    seed_run(database, "a-done", owner_uid=ALICE, owner_name="15001", running=False)
    with database.session() as s:
        done = s.get(Run, "a-done")
        assert done is not None
        done.state = RunState.FAILED  # ended runs do not count
    metrics = DaemonMetrics()
    ops = operations(
        database,
        slurm=None,  # type: ignore[arg-type]  # create_run does not ask Slurm
        quota=RunQuota(max_active=2, exempt=frozenset({str(BOB)})),
        on_refusal=metrics.count_refusal,
    )
    assert ops["create_run"](ALICE, {"spec": SPEC})["run_id"]  # her second pending or running
    for _ in range(2):
        with pytest.raises(RpcError) as refused:
            ops["create_run"](ALICE, {"spec": SPEC})
        assert str(refused.value) == (
            "run quota: 15001 has 2 runs pending or running, the most "
            "daemon.max_active_runs_per_user (2) allows; cancel one (`slurmft cancel RUN`) or "
            "wait for one to end"
        )
    for _ in range(3):  # root and the exempt (test) user are not counted
        ops["create_run"](0, {"spec": SPEC})
        ops["create_run"](BOB, {"spec": SPEC})
    assert _refused(metrics, "run_quota") == 2
    (audit,) = _refusals(database)  # the second refusal within the minute is not written again
    assert (audit.status, audit.evidence) == (
        ActionStatus.DONE,
        {"user": "15001", "limit": "run_quota"},
    )
    assert audit.reason.startswith("run quota: 15001 has 2 runs")
    with database.session() as s:
        owners = [r.owner_uid for r in s.scalars(select(Run).where(Run.state == "pending"))]
    assert sorted(owners) == [0, 0, 0, ALICE, BOB, BOB, BOB]


@pytest.fixture
def limited(
    database: Database, seed_run: Callable[..., None]
) -> Iterator[tuple[IngestServer, str, DaemonMetrics]]:
    token, digest = new_run_token()
    seed_run(database, "r1", job_id="7", owner_uid=ALICE, owner_name="alice", token_hash=digest)
    metrics = DaemonMetrics()
    server = IngestServer(
        database,
        observe=metrics.observe_ingest,
        # A burst of two batches and two events, then one of each per 100 s.
        rate_limits=RateLimits(batches_per_s=0.01, events_per_s=0.01, burst_s=200.0),
    ).start()
    try:
        yield server, token, metrics
    finally:
        server.stop()


def _post(server: IngestServer, batch: AgentBatch, token: str) -> tuple[int, str | None, str]:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(
            "POST", BATCH_PATH, body=batch.to_json(), headers={"Authorization": f"Bearer {token}"}
        )
        response = conn.getresponse()
        return response.status, response.getheader("Retry-After"), response.read().decode()
    finally:
        conn.close()


def _batch(seq: int, events: int = 0) -> AgentBatch:
    now = time.time()
    return AgentBatch(
        run_id="r1",
        agent_id="n1-a",
        node="n1",
        seq=seq,
        sent_at=now,
        events=tuple(AgentEvent("checkpoint", now, f"e{i}") for i in range(events)),
    )


def test_a_run_over_its_ingest_rate_is_answered_429_counted_and_recorded_once(
    database: Database, limited: tuple[IngestServer, str, DaemonMetrics]
) -> None:
    server, token, metrics = limited
    assert _post(server, _batch(1, events=2), token)[0] == 200
    status, retry_after, body = _post(server, _batch(2, events=1), token)  # past the events' burst
    assert status == 429 and retry_after is not None and 99 <= int(retry_after) <= 100
    assert "run r1 is over its ingest rate (0.01 batches and 0.01 events a second" in body
    assert _post(server, _batch(3), token)[0] == 200  # the refused batch took no batch token
    status, retry_after, body = _post(server, _batch(4), token)  # past the batches' burst
    assert status == 429 and retry_after is not None and 1 <= int(retry_after) <= 100
    assert _refused(metrics, "ingest_rate") == 2
    (audit,) = _refusals(database)  # one per run per minute, however often it is refused
    assert audit.run_id == "r1" and audit.evidence == {"user": "alice", "limit": "ingest_rate"}
    assert "(user alice)" in audit.reason
    assert json.loads(body)["error"].startswith("run r1 is over its ingest rate")
