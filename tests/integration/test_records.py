from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from sqlalchemy import select

from slurmft.db import Database
from slurmft.db.history import read_view
from slurmft.db.models import Action, ActionKind, ActionStatus, EventKind, FaultClass, utcnow
from slurmft.db.records import (
    denied_nodes,
    denylist_add,
    denylist_remove,
    finish_action,
    plan_action,
    record_event,
)


def test_an_action_is_recorded_before_and_after_it_runs(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1")
    with database.session() as s:
        event = record_event(
            s,
            EventKind.GPU_FAULT,
            "Xid 79 GPU fell off the bus (GPU 3)",
            run_id="r1",
            node="n2",
            xid=79,
            gpu_index=3,
            fault_class=FaultClass.HARDWARE,
            details={"pci": "0000:3b:00"},
        )
        action = plan_action(
            s,
            ActionKind.DRAIN_NODE,
            "slurmft: Xid 79 GPU fell off the bus",
            run_id="r1",
            node="n2",
            event_id=event.id,
            evidence={"xid": 79, "gpu": 3},
        )
        action_id = action.id
    with database.session() as s:
        planned = s.get(Action, action_id)
        assert planned is not None and planned.status is ActionStatus.PLANNED
        finish_action(planned, ActionStatus.FAILED, error="Permission denied: drain requested")
    with database.session() as s:
        row = s.get(Action, action_id)
        assert row is not None
        assert (row.status, row.error, row.evidence) == (
            ActionStatus.FAILED,
            "Permission denied: drain requested",
            {"xid": 79, "gpu": 3},
        )
        assert row.finished_at is not None and row.finished_at >= row.created_at
        assert read_view(s, "failures_by_node")[0]["xid"] == 79
    with pytest.raises(ValueError):
        finish_action(row, ActionStatus.PLANNED)


def test_denylist_scopes_expiry_and_removal(
    database: Database, seed_run: Callable[..., None]
) -> None:
    seed_run(database, "r1")
    seed_run(database, "r2")
    with database.session() as s:
        first = denylist_add(s, "n1", "Xid 79")
        again = denylist_add(s, "n1", "Xid 79 again")
        assert again.id == first.id  # an active entry is reused, not duplicated
        denylist_add(s, "n2", "straggler in r1", run_id="r1")
        denylist_add(s, "n3", "maintenance", expires_at=utcnow() - timedelta(minutes=1))
        denylist_add(s, "n4", "until tomorrow", expires_at=utcnow() + timedelta(days=1))
    with database.session() as s:
        assert denied_nodes(s) == {"n1", "n4"}
        assert denied_nodes(s, run_id="r1") == {"n1", "n2", "n4"}
        assert denied_nodes(s, run_id="r2") == {"n1", "n4"}
        assert denylist_remove(s, "n2") == 0  # the global scope has no n2
        assert denylist_remove(s, "n2", run_id="r1") == 1
        assert denylist_remove(s, "n1") == 1
    with database.session() as s:
        assert denied_nodes(s, run_id="r1") == {"n4"}
        assert len(s.scalars(select(Action)).all()) == 0
