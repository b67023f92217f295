"""The daemon's side of a test, as the daemon runs it: posting to its real ingest endpoint, and
one control pass's restart count (gather reads, decide counts, act records)."""

from __future__ import annotations

import http.client
import json

from slurmft.controller.act import Executor
from slurmft.controller.decide import count_restarts
from slurmft.controller.http import IngestServer
from slurmft.controller.restarts import restart_evidence
from slurmft.controller.views import Action, RunView
from slurmft.core.budget import RestartBudget
from slurmft.db import Database
from slurmft.db.models import Run
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
