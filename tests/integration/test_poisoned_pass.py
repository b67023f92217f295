"""No user's evidence stops the control pass for others (issue 46, items 1 and 3): bob's run
posts through the real ingest endpoint into a real store (SQLite and PostgreSQL), and the
daemon's own control pass runs against the recorded Slurm cluster.

Bob's run was made over the socket: it has a token and no Slurm job. Alice's run is the
recorded completed job: a pass that reaches her run ends it. The recorded running job is root's
and tagged `slurmft-run:run-0001`: that run is the one whose part of the pass is made to fail.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.registry import CollectorRegistry
from sqlalchemy import select
from support.daemon_side import daemon_config, post_batch
from support.slurm_recordings import RecordedJobs, recorded_jobs

from slurmft.controller import allocation, pass_health, run_status
from slurmft.controller.admins import ROOT_ONLY
from slurmft.controller.daemon import Daemon
from slurmft.controller.health import LoopLiveness, check_health
from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.controller.metrics import StoreCollector
from slurmft.controller.rpc import RpcError
from slurmft.controller.user_ops import release_held_run
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, Event, EventKind, Run, utcnow
from slurmft.db.records import record_event
from slurmft.db.states import RunState

BOB, ALICE, ROOTS = "rbob", "ralice", "run-0001"
RUNNING, _, DONE = recorded_jobs()
# The event bob posted on the parent commit: `nodes` an int where a list of members goes.
POISON = {"job_id": "1", "nodes": 5}


@pytest.fixture
def bob_token(database: Database, seed_run: Callable[..., None]) -> str:
    token, digest = new_run_token()
    seed_run(database, BOB, owner_uid=1001, owner_name="bob", running=False, token_hash=digest)
    seed_run(database, ALICE, job_id=DONE, owner_uid=1000, owner_name="alice")
    return token


@pytest.fixture
def daemon(tmp_path: Path, database: Database) -> Iterator[Daemon]:
    config = daemon_config(tmp_path)
    yield Daemon(config, database=database, slurm=RecordedJobs())


def _post_event(server: IngestServer, token: str, event: dict[str, Any]) -> tuple[int, Any]:
    now = time.time()
    batch = {
        "v": 1,
        "run_id": BOB,
        "agent_id": "n1-bob",
        "node": "n1",
        "seq": 1,
        "sent_at": now,
        "events": [{"occurred_at": now, "message": "", **event}],
    }
    return post_batch(server, json.dumps(batch).encode(), token)


def _state(database: Database, run_id: str) -> RunState:
    with database.session() as s:
        run = s.get(Run, run_id)
        assert run is not None
        return run.state


@pytest.mark.parametrize(
    ("event", "names"),
    [
        ({"kind": "allocation", "details": POISON}, "kind: 'allocation' is recorded by the daemon"),
        ({"kind": "node_lost"}, "kind: 'node_lost' is recorded by the daemon"),
        ({"kind": "control_error"}, "kind: 'control_error' is recorded by the daemon"),
        ({"kind": "hang", "details": {"key": "hang:n2"}}, "details.key: a key only the daemon"),
        ({"kind": "checkpoint", "details": {"step": "9"}}, "details.step: expected `int"),
        ({"kind": "gpu_fault", "details": {"code": {"a": 1}}}, "details.code: expected"),
    ],
)
def test_what_only_the_daemon_records_and_mistyped_details_are_refused_naming_the_item(
    ingest_server: IngestServer, bob_token: str, database: Database, event: dict[str, Any],
    names: str,
) -> None:  # fmt: skip
    status, reply = _post_event(ingest_server, bob_token, event)

    assert status == 422
    (refused,) = reply["refused"]
    assert (refused["items"], refused["index"]) == ("events", 0)
    assert refused["reason"].startswith(f"batch.events[0].{names}")
    with database.session() as s:
        assert s.scalars(select(Event).where(Event.run_id == BOB)).all() == []


def test_an_allocation_event_stored_before_the_boundary_is_refused_and_the_pass_goes_on(
    database: Database, bob_token: str, daemon: Daemon
) -> None:
    # As the parent commit's ingest stored bob's `allocation` event: unjudged, from an agent.
    with database.session() as s:
        poison = record_event(
            s, EventKind.ALLOCATION, "", run_id=BOB, details=POISON, source="agent"
        ).id

    for _ in range(2):
        daemon.control_pass()

    assert daemon.skipped_because is None
    assert _state(database, ALICE) is RunState.COMPLETED
    with database.session() as s:
        report = s.get(Event, poison)
        assert report is not None and report.foreign is True
        (refusal,) = s.scalars(
            select(Event).where(Event.run_id == BOB, Event.id != poison)
        ).all()
        assert refusal.message.startswith("allocation report refused: the report is malformed")
        assert s.get(Run, BOB).control_failures == 0  # type: ignore[union-attr]


def test_an_agents_word_is_never_taken_for_the_daemons_finding(
    database: Database, bob_token: str
) -> None:
    # A row no agent can post now: a hang with the key of the daemon's own finding.
    with database.session() as s:
        record_event(s, EventKind.HANG, "", run_id=BOB, details={"key": "k"}, source="agent")
        record_event(s, EventKind.HANG, "", run_id=BOB, details={"key": "d"})
    from slurmft.controller.observe import _reported_keys

    with database.session() as s:
        keys = _reported_keys(s, BOB, datetime(2020, 1, 1, tzinfo=UTC), now=datetime.now(UTC))
    assert keys == {"d"}


@pytest.fixture
def failing_run(
    database: Database, seed_run: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> str:
    """root's run of the recorded running job, whose evidence cannot be judged (a bug)."""
    seed_run(database, ROOTS, job_id=RUNNING)
    judge = allocation._judge_run_evidence

    def broken(session: Any, run_id: str) -> None:
        if run_id == ROOTS:
            raise RuntimeError("a bug in judging")
        judge(session, run_id)

    monkeypatch.setattr(allocation, "_judge_run_evidence", broken)
    return ROOTS


def _held_metric(database: Database) -> float:
    registry = CollectorRegistry()
    registry.register(StoreCollector(database))
    value = registry.get_sample_value("slurmft_runs_held")
    assert value is not None
    return value


def test_a_run_whose_part_fails_three_passes_is_held_shown_released_and_still_cancelled(
    database: Database, bob_token: str, daemon: Daemon, failing_run: str
) -> None:
    daemon.control_pass()
    # The others are served in the very pass that failed for it.
    assert _state(database, ALICE) is RunState.COMPLETED
    with database.session() as s:
        (error,) = s.scalars(select(Event).where(Event.kind == EventKind.CONTROL_ERROR)).all()
        assert (error.run_id, error.message) == (
            failing_run,
            "control pass: judging its evidence failed: RuntimeError: a bug in judging",
        )
        assert s.get(Run, failing_run).control_failures == 1  # type: ignore[union-attr]
    for _ in range(2):
        daemon.control_pass()
    assert daemon.skipped_because is None

    with database.session() as s:
        run = s.get(Run, failing_run)
        assert run is not None and run.control_failures == pass_health.HOLD_AFTER
        shown = run_status.status(s, run, utcnow(), 5)
        assert shown["held"] is True
        assert shown["control_error"] == "judging its evidence: RuntimeError: a bug in judging"
        (hold,) = s.scalars(select(Action).where(Action.kind == ActionKind.HOLD_RUN)).all()
        assert hold.run_id == failing_run and "3 passes in a row" in hold.reason
    assert _held_metric(database) == 1
    health = check_health(LoopLiveness(60), database)
    assert health.ok and health.checks["held_runs"] == [failing_run]

    # Held: its part is no longer tried, and no more failures are counted.
    daemon.control_pass()
    with database.session() as s:
        assert s.get(Run, failing_run).control_failures == 3  # type: ignore[union-attr]

    # Released by an admin (only): tried again at the next pass, from zero.
    with pytest.raises(RpcError, match="only an admin"):
        release_held_run(database, ROOT_ONLY, 1001, {"run_id": failing_run})
    answer = release_held_run(database, ROOT_ONLY, 0, {"run_id": failing_run})
    assert answer["released"] is True and answer["failures"] == 3
    daemon.control_pass()
    with database.session() as s:
        assert s.get(Run, failing_run).control_failures == 1  # type: ignore[union-attr]
        (release,) = s.scalars(select(Action).where(Action.kind == ActionKind.RELEASE_RUN)).all()
        assert release.reason.startswith("released by root after 3 failing passes")

    # Held again, then cancelled by its owner: the cancel is carried out.
    for _ in range(2):
        daemon.control_pass()
    with database.session() as s:
        run = s.get(Run, failing_run)
        assert run is not None and pass_health.is_held(run)
        run.cancel_requested_at = utcnow()
    daemon.control_pass()
    assert _state(database, failing_run) is RunState.CANCELLED
    assert daemon.slurm.cancelled == [RUNNING]  # type: ignore[attr-defined]
    assert _held_metric(database) == 0  # an ended run's hold is history
