"""Effective time per UTC day: the runs' training time cut at midnight, beside the time lost.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 07:00:00

`time_lost_by_day` (0007) gives what was lost each day but not what it was lost out of.
`effective_time_by_day` adds the other half: each run's span (the one `run_effective_time`
takes its wall time over: first step to newest step, or job start to end for a script without
steps, up to now while it runs) is cut at UTC midnights, and each day gets the part of every
run's span that fell on it. Lost time is counted on the day its failure occurred, as in
`time_lost_by_day`, so an outage across midnight is all on its first day; a day's effective
time is never below zero. The SQL is frozen here, as in 0002.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OUTAGE_KINDS = "'rank_failure', 'node_lost', 'gpu_fault', 'hang', 'batch_host_down'"
TERMINAL = "'completed', 'failed', 'cancelled', 'stopped'"
DAY_S = 86400


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def _epoch(expr: str) -> str:
    if _sqlite():
        return f"((julianday({expr}) - 2440587.5) * 86400.0)"
    return f"EXTRACT(EPOCH FROM {expr})"


def _day_of_epoch(expr: str) -> str:
    if _sqlite():
        return f"date({expr}, 'unixepoch')"
    return f"to_char(to_timestamp({expr}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


def _day(expr: str) -> str:
    if _sqlite():
        return f"date({expr})"
    return f"to_char({expr}, 'YYYY-MM-DD')"


def _least(a: str, b: str) -> str:
    return f"min({a}, {b})" if _sqlite() else f"LEAST({a}, {b})"


def _greatest(a: str, b: str) -> str:
    return f"max({a}, {b})" if _sqlite() else f"GREATEST({a}, {b})"


def _view() -> str:
    now = _epoch("CURRENT_TIMESTAMP")
    # The same span as run_effective_time's wall time (0007).
    end = f"""CASE WHEN r.first_step_at IS NULL
                   THEN COALESCE({_epoch("r.ended_at")}, {now})
                   WHEN r.state IN ({TERMINAL})
                   THEN {_epoch("COALESCE(r.last_step_at, r.ended_at)")}
                   ELSE {now} END"""
    begin = _epoch("COALESCE(r.first_step_at, r.started_at)")
    # The midnight the span starts after: epochs are positive, so SQLite's cast truncates
    # as FLOOR would (SQLite has FLOOR only when built with its math functions).
    whole_days = (
        f"CAST(s.begin_s / {DAY_S} AS INTEGER)" if _sqlite() else f"FLOOR(s.begin_s / {DAY_S})"
    )
    midnight = f"{whole_days} * {DAY_S}"
    part = f"""{_least("d.end_s", f"d.day_s + {DAY_S}")} - {_greatest("d.begin_s", "d.day_s")}"""
    return f"""
        WITH RECURSIVE spans AS (
            SELECT r.id AS run_id, {begin} AS begin_s, {end} AS end_s,
                   CASE WHEN r.first_step_at IS NULL THEN 1 ELSE 0 END AS estimate
            FROM runs r WHERE r.started_at IS NOT NULL
        ), days AS (
            SELECT s.run_id, s.begin_s, s.end_s, s.estimate, {midnight} AS day_s
            FROM spans s WHERE s.end_s > s.begin_s
            UNION ALL
            SELECT d.run_id, d.begin_s, d.end_s, d.estimate, d.day_s + {DAY_S}
            FROM days d WHERE d.day_s + {DAY_S} < d.end_s
        ), wall AS (
            SELECT {_day_of_epoch("d.day_s")} AS day, COUNT(DISTINCT d.run_id) AS runs,
                   SUM({part}) AS wall_s, MAX(d.estimate) AS estimate
            FROM days d GROUP BY d.day_s
        ), lost AS (
            SELECT {_day("e.occurred_at")} AS day, COUNT(*) AS failures,
                   COALESCE(SUM(e.time_lost_s), 0) AS lost_s,
                   COALESCE(SUM(e.lost_detection_s), 0) AS detection_s,
                   COALESCE(SUM(e.lost_restart_s), 0) AS restart_s,
                   COALESCE(SUM(e.lost_queue_wait_s), 0) AS queue_wait_s,
                   COALESCE(SUM(e.lost_replay_s), 0) AS replay_s,
                   SUM(CASE WHEN e.time_lost_s IS NULL THEN 1 ELSE 0 END) AS unmeasured,
                   MAX(CASE WHEN e.time_lost_estimate THEN 1 ELSE 0 END) AS estimate
            FROM events e
            WHERE e.kind IN ({OUTAGE_KINDS}) AND COALESCE(e."foreign", FALSE) = FALSE
            GROUP BY {_day("e.occurred_at")}
        ), keys AS (
            SELECT day FROM wall UNION SELECT day FROM lost
        )
        SELECT k.day AS day, COALESCE(w.runs, 0) AS runs,
               COALESCE(w.wall_s, 0) AS wall_s, COALESCE(l.lost_s, 0) AS lost_s,
               {_greatest("COALESCE(w.wall_s, 0) - COALESCE(l.lost_s, 0)", "0")} AS effective_s,
               CASE WHEN COALESCE(w.wall_s, 0) <= 0 THEN NULL
                    ELSE {_greatest("w.wall_s - COALESCE(l.lost_s, 0)", "0")} * 1.0 / w.wall_s
               END AS effective_ratio,
               COALESCE(l.detection_s, 0) AS detection_s,
               COALESCE(l.restart_s, 0) AS restart_s,
               COALESCE(l.queue_wait_s, 0) AS queue_wait_s,
               COALESCE(l.replay_s, 0) AS replay_s,
               COALESCE(l.failures, 0) AS failures, COALESCE(l.unmeasured, 0) AS unmeasured,
               {_greatest("COALESCE(w.estimate, 0)", "COALESCE(l.estimate, 0)")} AS estimate
        FROM keys k
        LEFT JOIN wall w ON w.day = k.day
        LEFT JOIN lost l ON l.day = k.day"""


def upgrade() -> None:
    op.execute(f"CREATE VIEW effective_time_by_day AS {_view()}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS effective_time_by_day")
