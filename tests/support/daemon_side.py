"""The daemon's side of a test, as the daemon runs it: posting to its real ingest endpoint, and
one control pass's restart count (gather reads, decide counts, act records)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from slurmft.config import Config, load_config
from slurmft.controller.act import Executor
from slurmft.controller.decide import count_restarts
from slurmft.controller.http import IngestServer
from slurmft.controller.restarts import restart_evidence
from slurmft.controller.views import Action, RunView
from slurmft.core.budget import RestartBudget
from slurmft.db import Database
from slurmft.db.models import AgentCursor, Base, Run
from slurmft.protocol import BATCH_PATH


def post_batch(
    server: IngestServer, body: bytes, token: str | None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object]]:
    """POST one request body to the ingest endpoint: (HTTP status, the reply's JSON)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", BATCH_PATH, body=body, headers=all_headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post_raw(server: IngestServer, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` (request line, headers and body, as bytes) to the ingest endpoint as
    is: for what http.client would not send (a Content-Length of "²"). (status, body)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def store_state(database: Database) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """The row count of every table, and every agent's cursor: what a refused batch must leave
    as it was."""
    with database.session() as s:
        counts = {
            table.name: s.execute(select(func.count()).select_from(table)).scalar_one()
            for table in Base.metadata.sorted_tables
        }
        cursors = {(c.run_id, c.agent_id): c.last_seq for c in s.scalars(select(AgentCursor))}
    return counts, cursors


def count_and_record(
    database: Database, run_id: str, cap: int = 5
) -> tuple[RestartBudget, list[Action]]:
    """One pass's count of the run's restart budget, recorded in the store as act records it;
    returns the budget and the bookkeeping actions decide asked for."""
    with database.session() as s:
        run = s.get(Run, run_id)
        assert run is not None
        view = RunView(
            run_id,
            run.nodes,
            None,
            budget=RestartBudget(restarts_without_progress=run.restarts_without_progress),
            restarts=restart_evidence(s, run),
        )
    budget, actions = count_restarts(view, cap=cap)
    Executor(database, slurm=None).execute(actions)  # type: ignore[arg-type]  # records only
    return budget, actions


def daemon_config(tmp_path: Path, *overrides: str) -> Config:
    """An in-process daemon's settings: its state and runtime under ``tmp_path``, no system
    file, its endpoints on free loopback ports, a pass every half second; ``overrides`` last."""
    return load_config(
        environ={},
        system_file=tmp_path / "absent.toml",
        overrides=[
            f"paths.state_dir={tmp_path / 'state'}",
            f"paths.runtime_dir={tmp_path / 'run'}",
            "daemon.poll_interval_s=0.5",
            "daemon.ingest_listen=127.0.0.1:0",
            "daemon.metrics_listen=127.0.0.1:0",
            *overrides,
        ],
    )


class BlockedSlurm:
    """A pass stuck outside Slurm's commands (a wedged lock, a hung filesystem): the stop
    cannot end it."""

    def __init__(self) -> None:
        self.blocked, self.release = threading.Event(), threading.Event()

    def jobs(self, job_ids: Sequence[str]) -> dict[str, Any]:
        self.blocked.set()
        self.release.wait(120)
        return {}

    def nodes(self, names: Sequence[str] = ()) -> dict[str, Any]:
        return {}

    def node_addresses(self) -> dict[str, str]:
        return {}
