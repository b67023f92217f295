"""The daemon's endpoints hold up against clients that connect and then do nothing, or next to
nothing (issue 14, item 7): idle connections hold no thread, a head that trickles in is cut off at
the header timeout, a server at its cap says so, and a token is checked before a body is read.

Small and quick on purpose (tens of connections, timeouts of a second); the figures for 1,000 idle
and 200 slow connections beside real agents come from scripts/bench/slow_clients.py.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import select
from support.waiting import wait_for

from slurmft.agent.reporter import CertificateError, HttpTransport
from slurmft.controller.bounded import ServerLimits
from slurmft.controller.http import IngestServer, server_tls
from slurmft.controller.ingest import new_run_token
from slurmft.controller.refusals import Refusals
from slurmft.controller.rpc import RpcError, RpcServer, call
from slurmft.core.kinds import ActionKind
from slurmft.db import Database
from slurmft.db.models import Action
from slurmft.protocol import BATCH_PATH, AgentBatch, RankHeartbeat

IDLE, SLOW = 30, 10
LIMITS = ServerLimits(
    max_connections=IDLE + SLOW + 8,
    workers=4,
    header_timeout_s=1.5,
    body_timeout_s=1.0,
    idle_timeout_s=1.0,
)
BYTE_EVERY_S = 0.25  # a slow client: one byte of its head this often, never a gap of idle_timeout
HEAD = b"POST " + BATCH_PATH.encode() + b" HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    """SQLite only: the bounds are the servers', the store's part is test_ingest's (both)."""
    db = Database(f"sqlite:///{tmp_path / 'slurmft.db'}")
    db.upgrade()
    try:
        yield db
    finally:
        db.dispose()


@pytest.fixture
def token(database: Database, seed_run: Callable[..., None]) -> str:
    token, digest = new_run_token()
    seed_run(database, "r1", job_id="7", token_hash=digest)
    return token


def _batch(seq: int = 1) -> bytes:
    now = time.time()
    beat = RankHeartbeat(rank=0, local_rank=0, phase="step", step=seq, progress_age_s=0.1,
                         deadline_s=300.0, overdue=False, sent_at=now)  # fmt: skip
    batch = AgentBatch(run_id="r1", agent_id="a-n1", node="n1", seq=seq, sent_at=now,
                       heartbeats=(beat,))  # fmt: skip
    return batch.to_json()


def _post(url: str, body: bytes, token: str, headers: dict[str, str] | None = None,
          timeout_s: float = 10.0) -> tuple[int, dict[str, object]]:  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.putrequest("POST", BATCH_PATH)
        conn.putheader("Authorization", f"Bearer {token}")
        for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            conn.putheader(name, value)
        conn.endheaders()
        if body:
            conn.send(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _connect_tcp(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _connect_unix(path: Path) -> socket.socket:
    """Connect as the CLI does, again while the listen backlog is full (EAGAIN on unix sockets)."""

    def attempt() -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            return None
        return sock

    return wait_for(attempt, 10, f"a connection to {path}", interval_s=0.01)


def _threads_while_held(
    connect: Callable[[], socket.socket], count: int, open_now: Callable[[], int]
) -> tuple[int, list[socket.socket]]:
    """Open ``count`` connections that send nothing; the thread count once the server holds all."""
    held = [connect() for _ in range(count)]
    wait_for(lambda: open_now() >= count, 10, f"the server holding {count} connections")
    return threading.active_count(), held


def _trickle(socks: list[socket.socket], payload: bytes) -> dict[int, tuple[float, bytes]]:
    """Send ``payload`` a byte every BYTE_EVERY_S down each socket until the server closes it;
    for each, the seconds from the first byte to the close, and what the server said."""
    started = time.monotonic()
    closed: dict[int, tuple[float, bytes]] = {}
    for sock in socks:
        sock.setblocking(False)
    sent = 0
    deadline = started + 20 * LIMITS.header_timeout_s
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for i, sock in enumerate(socks):
            if i in closed:
                continue
            said = b""
            try:
                while chunk := sock.recv(4096):
                    said += chunk
                gone = True  # recv returned b"": closed
            except BlockingIOError:
                gone = bool(said)
            except OSError:
                gone = True
            if not gone and sent < len(payload):
                try:
                    sock.send(payload[sent : sent + 1])
                except OSError:
                    gone = True
            if gone:
                closed[i] = (time.monotonic() - started, said)
        sent += 1
        time.sleep(BYTE_EVERY_S)  # the client's pace, not a wait for the server
    return closed


@pytest.fixture
def refusals(database: Database) -> tuple[Refusals, Counter]:
    counter = Counter("refusals", "", ["server", "reason"], registry=CollectorRegistry())
    return Refusals(database, counter), counter


@pytest.fixture
def ingest(database: Database, refusals: tuple[Refusals, Counter]) -> Iterator[IngestServer]:
    server = IngestServer(
        database,
        limits=LIMITS,
        on_refusal=refusals[0].ingest_hook,
        on_connection_refused=refusals[0].connection_hook("ingest"),
    ).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def rpc(refusals: tuple[Refusals, Counter]) -> Iterator[RpcServer]:
    runtime = Path(tempfile.mkdtemp(prefix="sft-rpc-"))
    ops = {"ping": lambda uid, _args: {"uid": uid}}
    server = RpcServer(
        runtime / "s.sock", ops, limits=LIMITS, on_refusal=refusals[0].connection_hook("socket")
    ).start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(runtime, ignore_errors=True)


def test_idle_connections_to_ingest_hold_no_thread_each(database: Database) -> None:
    server = IngestServer(database).start()  # the defaults, as the daemon runs them
    try:
        before = threading.active_count()
        during, held = _threads_while_held(
            lambda: _connect_tcp(server.url), IDLE, lambda: server.server.open_connections
        )
        assert during - before <= 2, f"{IDLE} idle connections made {during - before} threads"
        for sock in held:
            sock.close()
    finally:
        server.stop()


def test_idle_connections_to_the_socket_hold_no_thread_each() -> None:
    runtime = Path(tempfile.mkdtemp(prefix="sft-rpc-"))
    server = RpcServer(runtime / "s.sock", {}).start()
    try:
        before = threading.active_count()
        during, held = _threads_while_held(
            lambda: _connect_unix(server.path), IDLE, lambda: server.server.open_connections
        )
        assert during - before <= 2, f"{IDLE} idle connections made {during - before} threads"
        for sock in held:
            sock.close()
    finally:
        server.stop()
        shutil.rmtree(runtime, ignore_errors=True)


def test_slow_and_idle_clients_of_ingest_are_cut_off_and_agents_still_get_answers(
    database: Database, ingest: IngestServer, token: str, refusals: tuple[Refusals, Counter]
) -> None:
    before = threading.active_count()
    during, idle = _threads_while_held(
        lambda: _connect_tcp(ingest.url), IDLE, lambda: ingest.server.open_connections
    )
    slow = [_connect_tcp(ingest.url) for _ in range(SLOW)]
    # An agent's post is answered meanwhile, by one of the few workers.
    assert _post(ingest.url, _batch(), token)[0] == 200
    closed = _trickle(slow, HEAD)
    assert during - before <= LIMITS.workers + 16
    assert threading.active_count() - before <= LIMITS.workers + 16
    assert len(closed) == SLOW, f"only {len(closed)} of {SLOW} slow connections were closed"
    for seconds, said in closed.values():
        # Still sending at the deadline (a byte every 0.25 s of 200): cut off by the header
        # timeout, not the idle one, and told so.
        assert LIMITS.header_timeout_s - 0.1 <= seconds <= LIMITS.header_timeout_s + 5.0
        assert said.startswith(b"HTTP/1.0 408"), said
    for sock in idle + slow:
        sock.close()
    counter = refusals[1]
    assert counter.labels("ingest", "header_timeout")._value.get() == SLOW
    assert counter.labels("ingest", "idle_timeout")._value.get() == IDLE


def test_slow_and_idle_clients_of_the_socket_are_cut_off_and_named(
    database: Database, rpc: RpcServer, refusals: tuple[Refusals, Counter]
) -> None:
    rpc_path = rpc.path
    before = threading.active_count()
    during, idle = _threads_while_held(
        lambda: _connect_unix(rpc_path), IDLE, lambda: rpc.server.open_connections
    )
    slow = [_connect_unix(rpc_path) for _ in range(SLOW)]
    assert call(rpc_path, "ping") == {"uid": os.getuid()}  # the CLI is answered meanwhile
    closed = _trickle(slow, b'{"v": 1, "op": "ping", "args": {"pad": "' + b"a" * 200)
    assert during - before <= LIMITS.workers + 16
    assert len(closed) == SLOW
    for seconds, said in closed.values():
        assert LIMITS.header_timeout_s - 0.1 <= seconds <= LIMITS.header_timeout_s + 5.0
        assert b"did not arrive within 1.5s" in said, said
    for sock in idle + slow:
        sock.close()
    # The socket knows who its callers are: the refusals are audited under their uid.
    assert refusals[0].flush() >= 1
    with database.session() as s:
        rows = s.scalars(select(Action).where(Action.kind == ActionKind.REFUSE_REQUEST)).all()
        counts = {r.evidence["reason"]: r.evidence["count"] for r in rows}
        assert counts == {"header_timeout": SLOW, "idle_timeout": IDLE}
        assert {r.evidence["uid"] for r in rows} == {os.getuid()}


def test_past_its_cap_a_server_refuses_at_once_with_retry_after(
    database: Database, ingest: IngestServer, rpc: RpcServer, token: str
) -> None:
    held = [_connect_tcp(ingest.url) for _ in range(LIMITS.max_connections)]
    wait_for(lambda: ingest.server.open_connections >= LIMITS.max_connections, 10, "at the cap")
    extra = _connect_tcp(ingest.url)
    answer = extra.recv(4096)
    assert answer.startswith(b"HTTP/1.0 503") and b"Retry-After: 1" in answer, answer
    for sock in held:
        sock.close()
    wait_for(lambda: ingest.server.open_connections <= 1, 10, "the held connections closed")
    assert _post(ingest.url, _batch(), token)[0] == 200

    held = [_connect_unix(rpc.path) for _ in range(LIMITS.max_connections)]
    wait_for(lambda: rpc.server.open_connections >= LIMITS.max_connections, 10, "socket at cap")
    with pytest.raises(RpcError, match="the daemon is busy"):
        call(rpc.path, "ping")
    for sock in held:
        sock.close()


def test_an_unknown_token_is_refused_before_its_body_is_read(
    ingest: IngestServer, token: str
) -> None:
    # An unknown token with a promised 8 MB body that never comes: answered at once, unread.
    started = time.monotonic()
    status, data = _post(ingest.url, b"", "not-a-token", {"Content-Length": "8000000"},
                         timeout_s=LIMITS.body_timeout_s / 2)  # fmt: skip
    assert status == 401 and "token" in str(data["error"])
    assert time.monotonic() - started < LIMITS.body_timeout_s / 2


def test_a_content_length_that_is_no_number_is_a_400(ingest: IngestServer, token: str) -> None:
    # "²" is a digit to str.isdigit() but no number to int().
    status, data = _post(ingest.url, b"", token, {"Content-Length": "²"})
    assert status == 400 and "Content-Length" in str(data["error"])


def test_a_body_that_does_not_arrive_is_cut_off_at_the_body_timeout(
    database: Database, ingest: IngestServer, token: str, refusals: tuple[Refusals, Counter]
) -> None:
    started = time.monotonic()
    status, _ = _post(ingest.url, b"", token, {"Content-Length": "100"})
    assert status == 408
    assert time.monotonic() - started >= LIMITS.body_timeout_s - 0.1
    # The token named the run: the refusal is audited under it.
    assert refusals[0].flush() == 1
    with database.session() as s:
        row = s.scalars(select(Action).where(Action.kind == ActionKind.REFUSE_REQUEST)).one()
        assert (row.run_id, row.evidence["reason"], row.evidence["count"]) == (
            "r1",
            "body_timeout",
            1,
        )


def test_an_agent_posts_on_one_kept_connection_closed_quietly_once_idle(
    ingest: IngestServer, token: str, refusals: tuple[Refusals, Counter]
) -> None:
    transport = HttpTransport(ingest.url, token)
    for seq in (1, 2, 3):
        assert transport.send_batch(AgentBatch.from_json(_batch(seq))).acked_seq == seq
        time.sleep(LIMITS.idle_timeout_s / 4)
        # Kept between posts (a connection per post would be closed by now), by no thread.
        assert ingest.server.open_connections == 1
    assert ingest.server.worker_threads <= LIMITS.workers
    # Idle past idle_timeout_s: closed without a word, and no refusal counted.
    wait_for(lambda: ingest.server.open_connections == 0, 10, "the idle kept connection closed")
    assert transport.send_batch(AgentBatch.from_json(_batch(4))).acked_seq == 4
    assert refusals[1].labels("ingest", "idle_timeout")._value.get() == 0
    transport.close()


def test_kept_connections_hold_no_thread_between_posts(ingest: IngestServer, token: str) -> None:
    before = threading.active_count()
    transports = [HttpTransport(ingest.url, token) for _ in range(IDLE)]
    for seq, transport in enumerate(transports, 1):
        transport.send_batch(AgentBatch.from_json(_batch(seq)))
    assert ingest.server.open_connections == IDLE
    assert threading.active_count() - before <= LIMITS.workers + 2
    for transport in transports:
        transport.close()


def test_at_the_cap_the_idlest_kept_connection_makes_room_for_a_new_agent(
    ingest: IngestServer, token: str
) -> None:
    transports = [HttpTransport(ingest.url, token) for _ in range(LIMITS.max_connections)]
    for seq, transport in enumerate(transports, 1):  # the first posts first: idle longest
        transport.send_batch(AgentBatch.from_json(_batch(seq)))
    assert ingest.server.open_connections == LIMITS.max_connections
    # A new agent is answered, not refused; the first agent's kept connection made room...
    status, _ = _post(ingest.url, _batch(100), token)
    assert status == 200
    # ... and that agent, posting again, connects anew and is answered too.
    assert transports[0].send_batch(AgentBatch.from_json(_batch(101))).acked_seq == 101
    for transport in transports:
        transport.close()


def test_a_client_that_asks_for_close_or_pipelines_gets_its_connection_closed(
    ingest: IngestServer, token: str
) -> None:
    status, _ = _post(ingest.url, _batch(1), token, {"Connection": "close"})
    assert status == 200
    wait_for(lambda: ingest.server.open_connections == 0, 5, "the connection closed")
    # Two requests sent at once: the first answered, then the connection closed, the second
    # never parsed from what was read with the first (the client sends it again).
    head = (f"POST {BATCH_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            "Content-Length: {}\r\n\r\n")  # fmt: skip
    bodies = [_batch(2), _batch(3)]
    with _connect_tcp(ingest.url) as sock:
        sock.sendall(b"".join(head.format(len(b)).encode() + b for b in bodies))
        said = b""
        while chunk := sock.recv(65536):
            said += chunk
    assert said.startswith(b"HTTP/1.1 200") and said.count(b"HTTP/1.1") == 1, said


def test_a_store_busy_past_its_timeout_is_a_503_to_retry_not_a_500(
    tmp_path: Path, seed_run: Callable[..., None]
) -> None:
    url = f"sqlite:///{tmp_path / 'busy.db'}"
    database = Database(url, busy_timeout_ms=200)
    database.upgrade()
    token, digest = new_run_token()
    seed_run(database, "r1", job_id="7", token_hash=digest)
    server = IngestServer(database, limits=LIMITS).start()
    holder = Database(url)
    try:
        with holder.engine.connect() as held:
            held.exec_driver_sql("BEGIN IMMEDIATE")  # a long writer (a retention pass, say)
            status, reply = _post(server.url, _batch(1), token)
            held.exec_driver_sql("ROLLBACK")
        assert status == 503 and "retry later" in str(reply["error"]), reply
        assert _post(server.url, _batch(1), token)[0] == 200  # sent again, taken
    finally:
        server.stop()
        holder.dispose()
        database.dispose()


def _certificate(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_ingest_over_tls_takes_agents_that_trust_its_certificate_only(
    database: Database, token: str, tmp_path: Path, refusals: tuple[Refusals, Counter]
) -> None:
    cert, key = _certificate(tmp_path, "server")
    other_ca, _ = _certificate(tmp_path, "other")
    server = IngestServer(
        database,
        limits=LIMITS,
        tls=server_tls(str(cert), str(key)),
        on_connection_refused=refusals[0].connection_hook("ingest"),
    ).start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        reply = HttpTransport(server.url, token, ca_file=str(cert)).send_batch(
            AgentBatch.from_json(_batch())
        )
        assert reply.acked_seq == 1
        with pytest.raises(CertificateError, match=r"not trusted .* by CA file .*other\.pem"):
            HttpTransport(server.url, token, ca_file=str(other_ca)).server_time()
        # Plain HTTP to the TLS port is no request: the connection is closed, unanswered.
        plain = server.url.replace("https://", "http://")
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            _post(plain, _batch(), token)
        wait_for(
            lambda: refusals[1].labels("ingest", "tls_handshake")._value.get() >= 1,
            10,
            "the plain-HTTP connection counted as a failed TLS handshake",
        )
    finally:
        server.stop()


PER_USER = 5


@pytest.mark.skipif(os.geteuid() != 0, reason="holding connections as another uid needs root")
def test_one_user_cannot_hold_the_socket_against_the_others() -> None:
    runtime = Path(tempfile.mkdtemp(prefix="sft-rpc-"))
    runtime.chmod(0o755)
    limits = ServerLimits(
        max_connections=50, workers=2, header_timeout_s=30.0, body_timeout_s=5.0,
        idle_timeout_s=30.0, max_per_caller=PER_USER,
    )  # fmt: skip
    server = RpcServer(runtime / "s.sock", {"ping": lambda uid, _a: uid}, limits=limits).start()
    held_r, held_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a user who opens as many connections as they may, then one more
        try:
            os.setgid(15001)
            os.setuid(15001)
            held = [_connect_unix(server.path) for _ in range(PER_USER)]
            os.write(held_w, b"held\n")
            os.read(go_r, 1)
            extra = _connect_unix(server.path)
            os.write(held_w, extra.recv(4096) or b"(closed)")
            del held
        finally:
            os._exit(0)
    try:
        assert os.read(held_r, 5) == b"held\n"
        wait_for(lambda: server.server.open_connections >= PER_USER, 10, "the user's connections")
        assert call(server.path, "ping") == 0  # another caller is answered meanwhile
        os.write(go_w, b"x")
        refusal = os.read(held_r, 4096)
        assert f"you have {PER_USER} requests open".encode() in refusal, refusal
    finally:
        os.waitpid(pid, 0)
        server.stop()
        shutil.rmtree(runtime, ignore_errors=True)
