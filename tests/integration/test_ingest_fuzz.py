"""Issue 14, items 9 and 16: hostile payloads through the daemon's real HTTP ingest endpoint, on
SQLite and on PostgreSQL.

At least 10,000 generated payloads per store: a valid batch with one field made hostile (the
wrong type, a huge number, a NUL byte, bytes that are not UTF-8, nesting thousands deep, a
string past the store's column), under the run's own token, another run's, a made-up one or
none, from the run's own node or a foreign one; and whole bodies of random bytes or JSON. Each
is answered (never a 5xx: the daemon stays up); after every refused one, the row count of every
table and every agent's cursor are what they were. Derandomized (the same payloads in every
run) and without a deadline: a shared machine's pauses are not failures.

The payloads come from hypothesis as one byte string per 100 of them (8 bytes each pick the
kind, the fields, the hostile values of a table built here, the token, the node): drawing them
from hypothesis strategies one by one cost 4.5 ms a payload on the development machine, more
than posting one (under load). Measured there (two shared cores): 10,000 payloads in 30 s on
SQLite and 58 s on PostgreSQL at a load average of 3 (150 s and 217 s at 10 to 40); the same
statuses every run (400: 3,686, 422: 3,840, 401: 1,292, 403: 501, 200: 681).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text
from support.waiting import wait_for

from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.db import Database
from slurmft.db.models import AgentCursor, Base, Event, StepTime
from slurmft.protocol import BATCH_PATH, TIME_PATH

PAYLOADS = int(os.environ.get("SLURMFT_FUZZ_PAYLOADS", "10000"))  # fewer only while developing
NOW = time.time()
HOSTILE = "__hostile__"
PER_EXAMPLE = 100  # payloads drawn as one byte string (see the module's note on the cost)
WIDTH = 8  # bytes of that string per payload
HUGE = [2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]

FUZZ = settings(
    max_examples=PAYLOADS // PER_EXAMPLE,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)


def _valid(seq: int, node: str) -> dict[str, Any]:
    """A batch of the run's agent on ``node``: two heartbeats, a step time, an event."""
    return {
        "v": 1,
        "run_id": "r1",
        "agent_id": f"{node}-agent",
        "node": node,
        "seq": seq,
        "sent_at": NOW,
        "heartbeats": [
            {
                "rank": r,
                "local_rank": r,
                "phase": "step",
                "step": seq,
                "progress_age_s": 0.1,
                "deadline_s": 300.0,
                "overdue": False,
                "sent_at": NOW,
                "restart_count": 0,
                "pid": 7,
            }
            for r in (0, 1)
        ],
        "step_times": [
            {
                "rank": 0,
                "step": seq,
                "compute_s": 0.2,
                "wait_s": 0.01,
                "ended_at": NOW,
                "peer_group": "g",
            },
        ],
        "events": [
            {
                "kind": "checkpoint",
                "occurred_at": NOW,
                "message": "saved",
                "rank": 0,
                "fault_class": None,
                "details": {"step": seq, "path": "/ckpt/1"},
            },
        ],
    }


# Where a hostile value goes: a path into the valid batch.
FIELDS: list[tuple[str | int, ...]] = (
    [(name,) for name in ("run_id", "agent_id", "node", "seq", "sent_at", "v")]
    + [
        ("heartbeats", 1, name)
        for name in (
            "rank",
            "local_rank",
            "phase",
            "step",
            "progress_age_s",
            "deadline_s",
            "overdue",
            "sent_at",
            "restart_count",
            "pid",
        )
    ]
    + [
        ("step_times", 0, name)
        for name in ("rank", "step", "compute_s", "wait_s", "ended_at", "peer_group")
    ]
    + [
        ("events", 0, name)
        for name in ("kind", "occurred_at", "message", "rank", "fault_class", "details")
    ]
    + [
        ("events", 0, "details", "step"),
        ("events", 0, "details", "xid"),
        ("events", 0, "details", "gpu_index"),
        ("events", 0, "details", "stacks"),
        ("heartbeats",),
        ("events",),
        ("heartbeats", 0),
        ("events", 0),
    ]
)


def _nested(depth: int, leaf: bytes = b"1") -> bytes:
    return b'{"a":' * depth + leaf + b"}" * depth


def _array(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _small_json(rng: random.Random, depth: int = 0) -> object:
    pick = rng.randrange(7 if depth < 3 else 4)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.randrange(-(2**70), 2**70)
    if pick == 3:
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(6)))
    if pick in (4, 5):
        return [_small_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {str(rng.randrange(100)): _small_json(rng, depth + 1) for _ in range(rng.randrange(3))}


def _fragments() -> list[bytes]:
    """Hostile JSON values (as bytes: some are not valid JSON, or not UTF-8), the simplest
    first (hypothesis shrinks towards index 0)."""
    rng = random.Random(14)
    table = [b"null", b'"x"', b'"1"', b"true", b"[]", b"{}", b"[1,2]", b"1.5", b'""']  # types
    table += [str(n).encode() for n in HUGE]  # huge numbers, as JSON allows them
    table += [b"1e20", b"-1e20", b"1e308", b"1e999", b"-1e999", b"5e-324", b"-0.0", b"1" * 400]
    table += [b"0", b"-1", b"4102444801", b"1577836799", b"NaN", b"Infinity", b"0x10"]
    table += [str(rng.randrange(-(2**80), 2**80) >> rng.randrange(80)).encode() for _ in range(80)]
    table += [
        repr(rng.uniform(-1, 1) * 10.0 ** rng.randrange(-300, 300)).encode() for _ in range(40)
    ]
    # NUL bytes, lone surrogates, control characters
    table += [b'"a\\u0000b"', b'"\\ud800"', b'"\\udfff x"', b'"\\u0001"', b'"\x00"', b'"\n"']
    table += [b'{"k":"\\u0000"}', b'{"\\u0000":1}', b'["\\u0000"]']
    table += [
        json.dumps(_small_json(rng) if rng.random() < 0.5 else "x" + "\x00").encode()
        for _ in range(20)
    ]
    # bytes that are not UTF-8
    table += [b'"\xff"', b'"\xc3"', b'"\xed\xa0\x80"', b'"\xf8\x88\x80\x80\x80"', b"\xff"]
    table += [
        b'"' + bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 9))) + b'"'
        for _ in range(40)
    ]
    # deep nesting
    table += [_nested(n) for n in (17, 64, 500, 1000, 5000, 20000)]
    table += [_array(n) for n in (17, 64, 1000, 5000)]
    table += [_nested(20, b'"\\u0000"'), _nested(3, b"1e999")]
    # strings past the store's columns
    table += [b'"' + b"n" * n + b'"' for n in (33, 65, 129, 70_000)]
    # small JSON values of any shape
    table += [json.dumps(_small_json(rng)).encode() for _ in range(80)]
    return table


FRAGMENTS = _fragments()
NODES = ["n1", "n2", "foreign-node", "n9.other.site", "n1"]


def _payload(chunk: bytes) -> tuple[bytes, int]:
    """A payload and the index of its token, from WIDTH bytes: mostly a valid batch with one or
    two fields hostile; else a hostile value, or random bytes, as the whole body."""
    kind, path_a, path_b, frag_a, frag_b, token, node, seq = chunk
    if kind >= 224:
        return FRAGMENTS[(frag_a << 8 | frag_b) % len(FRAGMENTS)], token
    if kind >= 208:
        return chunk * (1 + seq % 16), token
    batch = _valid(1 + seq * 3907, NODES[node % len(NODES)])
    paths = [FIELDS[path_a % len(FIELDS)]]
    if path_b < len(FIELDS) and FIELDS[path_b] != paths[0]:
        paths.append(FIELDS[path_b])
    values = [FRAGMENTS[frag_a % len(FRAGMENTS)], FRAGMENTS[frag_b % len(FRAGMENTS)]]
    markers = []
    for number, path in enumerate(paths):
        try:
            _place(batch, path, f"{HOSTILE}{number}")
        except (KeyError, IndexError, TypeError):  # the other path took its parent away
            continue
        markers.append((f'"{HOSTILE}{number}"'.encode(), values[number]))
    body = json.dumps(batch).encode()
    for marker, value in markers:
        body = body.replace(marker, value, 1)
    return body, token


def _place(batch: dict[str, Any], path: tuple[str | int, ...], marker: str) -> None:
    holder: Any = batch
    for step in path[:-1]:
        holder = holder[step]
    holder[path[-1]] = marker


class Endpoint:
    """The ingest endpoint over one kept-open connection (reopened after the server closes)."""

    def __init__(self, server: IngestServer) -> None:
        host, port = server.url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)

    def post(self, body: bytes, token: str | None) -> int:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        for attempt in (1, 2):
            try:
                self.conn.request("POST", BATCH_PATH, body=body, headers=headers)
                response = self.conn.getresponse()
                response.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()  # closed after an error answer: a new connection
                if attempt == 2:
                    raise
                continue
            if response.getheader("Connection", "").lower() == "close":
                self.conn.close()
            return response.status
        raise AssertionError("unreachable")

    def alive(self) -> bool:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("GET", TIME_PATH)
            return conn.getresponse().status == 200
        finally:
            conn.close()


class StoreState:
    """Every table's row count and every agent's cursor, read in two statements over one
    connection that sees each commit (autocommit: no snapshot is kept between reads)."""

    def __init__(self, database: Database) -> None:
        tables = [table.name for table in Base.metadata.sorted_tables]
        counts = ", ".join(f"(SELECT count(*) FROM {name})" for name in tables)
        self.tables = tables
        self.counts = text(f"SELECT {counts}")
        self.cursors = select(AgentCursor.run_id, AgentCursor.agent_id, AgentCursor.last_seq)
        self.conn = database.engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def read(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        row = self.conn.execute(self.counts).one()
        cursors = {(run, agent): seq for run, agent, seq in self.conn.execute(self.cursors)}
        return dict(zip(self.tables, row, strict=True)), cursors

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def run_tokens(database: Database, seed_run: Callable[..., None]) -> dict[str, str]:
    tokens = {}
    for run_id in ("r1", "r2"):
        token, digest = new_run_token()
        seed_run(database, run_id, job_id="7" if run_id == "r1" else "8", token_hash=digest)
        tokens[run_id] = token
    return tokens


def test_hostile_payloads_are_refused_and_leave_the_store_as_it_was(
    database: Database, ingest_server: IngestServer, run_tokens: dict[str, str]
) -> None:
    endpoint, state = Endpoint(ingest_server), StoreState(database)
    tokens = [run_tokens["r1"]] * 5 + [run_tokens["r2"], "made-up-token", None]
    seen = {"payloads": 0, "refused": 0}
    status_counts: dict[int, int] = {}
    baseline = [state.read()]

    @FUZZ
    @given(stream=st.binary(min_size=PER_EXAMPLE * WIDTH, max_size=PER_EXAMPLE * WIDTH))
    def post(stream: bytes) -> None:
        for start in range(0, len(stream), WIDTH):
            body, token = _payload(stream[start : start + WIDTH])
            status = endpoint.post(body, tokens[token % len(tokens)])
            seen["payloads"] += 1
            status_counts[status] = status_counts.get(status, 0) + 1
            assert status < 500, (status, body[:300])
            after = state.read()
            if status == 200:
                baseline[0] = after
                continue
            seen["refused"] += 1
            assert after == baseline[0], (status, body[:300])

    started = time.monotonic()
    try:
        post()
    finally:
        state.close()
    elapsed = time.monotonic() - started
    print(f"{seen['payloads']} payloads in {elapsed:.1f} s on {database.dialect}: {status_counts}")
    assert seen["payloads"] >= PAYLOADS and seen["refused"] >= PAYLOADS // 2, seen
    assert endpoint.alive()
    # Still storing: a good batch of a new agent.
    assert endpoint.post(json.dumps(_valid(1, "n3")).encode(), run_tokens["r1"]) == 200
    with database.session() as s:
        assert s.get(AgentCursor, ("r1", "n3-agent")) is not None


def test_a_refused_and_a_good_batch_queued_behind_a_held_writer_are_one_group(
    database: Database, ingest_server: IngestServer, run_tokens: dict[str, str]
) -> None:
    """Over HTTP, with the group writer held by its test hook: a batch refused for an item (an
    event time of 1e20, which decodes) and a good batch queue behind the held one; the good
    ones are stored by the group path, the refused one writes nothing."""
    committer = ingest_server.committer
    refused = _valid(5, "n2")
    refused["events"][0]["occurred_at"] = 1e20
    statuses: dict[str, int] = {}

    def post(name: str, body: dict[str, Any]) -> threading.Thread:
        endpoint = Endpoint(ingest_server)
        thread = threading.Thread(
            target=lambda: statuses.__setitem__(
                name, endpoint.post(json.dumps(body).encode(), run_tokens["r1"])
            )
        )
        thread.start()
        return thread

    with committer.hold():
        threads = [post("held", _valid(1, "n1"))]
        wait_for(committer.holding.is_set, 10, "the writer holding a batch", interval_s=0.01)
        threads += [post("refused", refused), post("good", _valid(1, "n3"))]
        wait_for(lambda: committer.queued() == 2, 10, "two batches queued", interval_s=0.01)
    for thread in threads:
        thread.join(30)
    assert statuses == {"held": 200, "refused": 422, "good": 200}
    assert (committer.groups, committer.batches, committer.fallbacks) == (1, 3, 0)
    with database.session() as s:
        assert set(s.scalars(select(AgentCursor.agent_id))) == {"n1-agent", "n3-agent"}
        assert len(s.scalars(select(StepTime.id)).all()) == 2  # one of each stored batch
        assert s.scalars(select(Event.node)).all() == ["n1", "n3"]
