"""Failure history: the SQL views created by the migrations, and how to read them.

The views are the documented interface (see docs/failure-history.md); this module only names them
and reads them, so `slurmft history` and a person at a SQL prompt see the same rows.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@dataclass(frozen=True)
class HistoryView:
    name: str
    question: str
    order_by: str
    has_run: bool = False


HISTORY_VIEWS: dict[str, HistoryView] = {
    v.name: v
    for v in (
        HistoryView(
            "failures_by_node", "Which nodes failed, how, and how often?", "failures DESC, node"
        ),
        HistoryView(
            "failures_by_class",
            "Which fault classes and Xids cost the most?",
            "failures DESC, fault_class",
        ),
        HistoryView(
            "run_failures",
            "How many failures did each run see, and what did they cost?",
            "time_lost_s DESC, run_id",
            has_run=True,
        ),
        HistoryView(
            "run_restarts",
            "How often was each run restarted, and why?",
            "restarts DESC, run_id",
            has_run=True,
        ),
        HistoryView("node_lemons", "Which nodes fail again and again?", "position, node"),
        HistoryView(
            "run_effective_time",
            "What fraction of each run's time was training, and where did the rest go?",
            "effective_ratio, run_id",
            has_run=True,
        ),
        HistoryView(
            "time_lost_by_node",
            "Which nodes cost the most training time, and how?",
            "lost_s DESC, node",
        ),
        HistoryView(
            "time_lost_by_class",
            "Which kinds of failure cost the most training time?",
            "lost_s DESC, fault_class, kind",
        ),
        HistoryView("time_lost_by_day", "How much training time was lost each UTC day?", "day"),
        HistoryView(
            "effective_time_by_day",
            "What fraction of each UTC day's training time was effective?",
            "day",
        ),
    )
}


class UnknownView(KeyError):
    pass


def read_view(
    session: Session,
    name: str,
    *,
    run_id: str | None = None,
    limit: int | None = None,
    only_runs: Collection[str] | None = None,
) -> list[dict[str, Any]]:
    """Rows of one history view as plain dicts (timestamps as ISO strings). ``only_runs``: a
    run view's rows of these runs only (a user's own, when the daemon answers for them)."""
    view = HISTORY_VIEWS.get(name)
    if view is None:
        raise UnknownView(name)
    from sqlalchemy import bindparam, text  # `slurmft history --help` lists views without it

    # The view name and ORDER BY come from the fixed table above, never from the caller.
    sql = f"SELECT * FROM {view.name}"
    params: dict[str, Any] = {}
    where = []
    if run_id is not None and view.has_run:
        where.append("run_id = :run_id")
        params["run_id"] = run_id
    if only_runs is not None and view.has_run:
        where.append("run_id IN :only_runs")
        params["only_runs"] = sorted(only_runs) or [""]
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY {view.order_by}"
    if limit is not None:
        sql += " LIMIT :limit"
        params["limit"] = limit
    statement = text(sql)
    if only_runs is not None and view.has_run:
        statement = statement.bindparams(bindparam("only_runs", expanding=True))
    result = session.execute(statement, params)
    return [{key: _plain(value) for key, value in row.items()} for row in result.mappings()]


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if value is not None and not isinstance(value, (int, float, str, bool)):
        return float(value)  # PostgreSQL numeric -> Decimal
    return value


def planning_counts(session: Session, *, now: datetime) -> dict[str, Any]:
    """What `slurmft plan --store` estimates rates from, read through the views: failures by
    kind (`failures_by_node`: the runs' own nodes only), restarts charged to the user's code
    (`run_restarts`), and the node-hours the allocations held (`allocation_nodes`, a node still
    held counted until its attempt ended, or until ``now``)."""
    from sqlalchemy import func, select

    from slurmft.db.models import AllocationNode, Attempt

    by_kind: dict[str, int] = {}
    for row in read_view(session, "failures_by_node"):
        by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + int(row["failures"])
    user_code = sum(int(row["user_code"] or 0) for row in read_view(session, "run_restarts"))
    held = session.execute(
        select(
            AllocationNode.joined_at,
            func.coalesce(AllocationNode.left_at, Attempt.ended_at).label("left"),
        ).join(Attempt, Attempt.id == AllocationNode.attempt_id)
    ).all()
    naive_now = now.replace(tzinfo=None)
    seconds = 0.0
    for joined, left in held:
        end = naive_now if left is None else left.replace(tzinfo=None)
        seconds += max(0.0, (end - joined.replace(tzinfo=None)).total_seconds())
    return {
        "failures_by_kind": dict(sorted(by_kind.items())),
        "user_code_restarts": user_code,
        "stragglers": by_kind.get("straggler", 0),
        "node_hours": seconds / 3600,
    }
