"""`slurmft history` and `slurmft report` for every user, answered by the daemon over its socket.

An ordinary user cannot read the daemon's store; the daemon reads it for them. A run view
(`run_failures`, `run_restarts`, `run_effective_time`) shows a user their own runs' rows only,
an admin every run's; the node and fault-class views hold no run and are the same for all. A
report is of a run the caller may see (slurmft.controller.visibility, as for `slurmft status`).
Admins, the daemon's user and a database role may still read the store directly (`--store`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select

from slurmft.controller.admins import Admins
from slurmft.controller.rpc import Operation, RpcError
from slurmft.controller.visibility import visible_run
from slurmft.db import Database
from slurmft.db.history import HISTORY_VIEWS, read_view
from slurmft.db.models import Run
from slurmft.report import DEFAULT_MAX_COLUMNS
from slurmft.report.steps import NoStepTimes, load_step_picture

MAX_HISTORY_ROWS = 10_000
MAX_REPORT_COLUMNS = 2_000


def history_operations(database: Database, admins: Admins) -> dict[str, Operation]:
    def history(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        view = args.get("view")
        if not isinstance(view, str) or view not in HISTORY_VIEWS:
            raise RpcError(f"unknown view {view!r}; choose one of: {', '.join(HISTORY_VIEWS)}")
        run_id = _optional_text(args.get("run_id"), "run_id")
        limit = _bounded(args.get("limit"), "limit", 1, MAX_HISTORY_ROWS, MAX_HISTORY_ROWS)
        with database.session() as session:
            if run_id is not None:
                visible_run(session, uid, run_id, admins)
            own = None
            if uid not in admins:
                own = set(session.scalars(select(Run.id).where(Run.owner_uid == uid)))
            rows = read_view(session, view, run_id=run_id, limit=limit, only_runs=own)
        return {"view": view, "rows": rows}

    def report(uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        run_id = _optional_text(args.get("run_id"), "run_id")
        if run_id is None:
            raise RpcError("a run id is required")
        columns = _bounded(
            args.get("max_columns"), "max_columns", 10, MAX_REPORT_COLUMNS, DEFAULT_MAX_COLUMNS
        )
        with database.session() as session:
            visible_run(session, uid, run_id, admins)
            try:
                picture = load_step_picture(session, run_id, max_columns=columns)
            except NoStepTimes as error:
                raise RpcError(str(error)) from None
        return picture.to_json()

    return {"history": history, "report": report}


def _optional_text(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 64:
        raise RpcError(f"{name}: expected a run id")
    return value


def _bounded(value: object, name: str, low: int, high: int, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RpcError(f"{name}: expected a whole number in [{low}, {high}]")
    return value
