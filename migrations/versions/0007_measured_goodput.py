"""Goodput measured: each outage's cost by cause, and the effective ratio from the steps.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 07:00:00

`events` gains the parts of `time_lost_s` (detection, restart, queue wait, replay) and whether
they are an estimate; `runs` gains the start of its first step and the end of its newest, the
span the effective ratio is taken over (docs/design.md). The daemon writes them once training
is back past a failure (slurmft.controller.goodput_pass).

`run_effective_time` is made again on them, with the lost time by cause and the initial wait
and start-up apart; `time_lost_by_node`, `time_lost_by_class` and `time_lost_by_day` are new.
Lost time counts outages only (a rank, a node, a GPU, a hang, the batch host), never evidence
judged foreign. The SQL is frozen here, as in 0002.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OUTAGE_KINDS = "'rank_failure', 'node_lost', 'gpu_fault', 'hang', 'batch_host_down'"
TERMINAL = "'completed', 'failed', 'cancelled', 'stopped'"
PARTS = """COUNT(*) AS failures,
                   COALESCE(SUM(e.time_lost_s), 0) AS lost_s,
                   COALESCE(SUM(e.lost_detection_s), 0) AS detection_s,
                   COALESCE(SUM(e.lost_restart_s), 0) AS restart_s,
                   COALESCE(SUM(e.lost_queue_wait_s), 0) AS queue_wait_s,
                   COALESCE(SUM(e.lost_replay_s), 0) AS replay_s,
                   SUM(CASE WHEN e.time_lost_s IS NULL THEN 1 ELSE 0 END) AS unmeasured,
                   MAX(CASE WHEN e.time_lost_estimate THEN 1 ELSE 0 END) AS estimate"""
OWN = f"""e.kind IN ({OUTAGE_KINDS}) AND COALESCE(e."foreign", FALSE) = FALSE"""


def _epoch(expr: str) -> str:
    if op.get_bind().dialect.name == "sqlite":
        return f"((julianday({expr}) - 2440587.5) * 86400.0)"
    return f"EXTRACT(EPOCH FROM {expr})"


def _day(expr: str) -> str:
    if op.get_bind().dialect.name == "sqlite":
        return f"date({expr})"
    return f"to_char({expr}, 'YYYY-MM-DD')"


def _views() -> dict[str, str]:
    now = _epoch("CURRENT_TIMESTAMP")
    # A run with steps: from its first step's start to its newest step's end (now, while it
    # runs). A script without steps: from its job's start to its end, an estimate.
    end = f"""CASE WHEN r.state IN ({TERMINAL})
                   THEN {_epoch("COALESCE(r.last_step_at, r.ended_at)")} ELSE {now} END"""
    return {
        "run_effective_time": f"""
            SELECT t.run_id, t.name, t.state, t.wall_s, t.lost_s,
                   CASE WHEN t.wall_s > t.lost_s THEN t.wall_s - t.lost_s ELSE 0 END
                       AS effective_s,
                   CASE WHEN t.wall_s IS NULL OR t.wall_s <= 0 THEN NULL
                        WHEN t.wall_s > t.lost_s THEN (t.wall_s - t.lost_s) * 1.0 / t.wall_s
                        ELSE 0 END AS effective_ratio,
                   t.detection_s, t.restart_s, t.queue_wait_s, t.replay_s,
                   t.failures, t.unmeasured, t.estimate, t.initial_wait_s, t.startup_s
            FROM (
                SELECT r.id AS run_id, r.name AS name, r.state AS state,
                       CASE WHEN r.first_step_at IS NOT NULL
                            THEN {end} - {_epoch("r.first_step_at")}
                            ELSE COALESCE({_epoch("r.ended_at")}, {now}) - {_epoch("r.started_at")}
                       END AS wall_s,
                       COALESCE(x.lost_s, 0) AS lost_s,
                       COALESCE(x.detection_s, 0) AS detection_s,
                       COALESCE(x.restart_s, 0) AS restart_s,
                       COALESCE(x.queue_wait_s, 0) AS queue_wait_s,
                       COALESCE(x.replay_s, 0) AS replay_s,
                       COALESCE(x.failures, 0) AS failures,
                       COALESCE(x.unmeasured, 0) AS unmeasured,
                       CASE WHEN r.first_step_at IS NULL OR x.estimate = 1 THEN 1 ELSE 0 END
                           AS estimate,
                       {_epoch("r.started_at")} - {_epoch("r.created_at")} AS initial_wait_s,
                       {_epoch("r.first_step_at")} - {_epoch("r.started_at")} AS startup_s
                FROM runs r
                LEFT JOIN (
                    SELECT e.run_id AS run_id, {PARTS}
                    FROM events e WHERE {OWN} GROUP BY e.run_id
                ) x ON x.run_id = r.id
                WHERE r.started_at IS NOT NULL
            ) t""",
        "time_lost_by_node": f"""
            SELECT e.node AS node, COUNT(DISTINCT e.run_id) AS runs, {PARTS}
            FROM events e WHERE e.node IS NOT NULL AND {OWN}
            GROUP BY e.node""",
        "time_lost_by_class": f"""
            SELECT COALESCE(e.fault_class, 'unknown') AS fault_class, e.kind AS kind,
                   COUNT(DISTINCT e.run_id) AS runs, {PARTS}
            FROM events e WHERE {OWN}
            GROUP BY COALESCE(e.fault_class, 'unknown'), e.kind""",
        "time_lost_by_day": f"""
            SELECT {_day("e.occurred_at")} AS day, COUNT(DISTINCT e.run_id) AS runs, {PARTS}
            FROM events e WHERE {OWN}
            GROUP BY {_day("e.occurred_at")}""",
    }


def _old_run_effective_time() -> str:
    """run_effective_time as 0002 made it."""
    now = _epoch("CURRENT_TIMESTAMP")
    kinds = (
        "'rank_failure', 'node_lost', 'gpu_fault', 'hang', 'straggler', 'batch_host_down', "
        "'preflight_failed'"
    )
    return f"""
            SELECT t.run_id, t.name, t.state, t.wall_s, t.lost_s,
                   CASE WHEN t.wall_s > t.lost_s THEN t.wall_s - t.lost_s ELSE 0 END
                       AS effective_s,
                   CASE WHEN t.wall_s <= 0 THEN NULL
                        WHEN t.wall_s > t.lost_s THEN (t.wall_s - t.lost_s) * 1.0 / t.wall_s
                        ELSE 0 END AS effective_ratio
            FROM (
                SELECT r.id AS run_id, r.name AS name, r.state AS state,
                       COALESCE({_epoch("r.ended_at")}, {now}) - {_epoch("r.started_at")}
                           AS wall_s,
                       COALESCE((SELECT SUM(e.time_lost_s) FROM events e
                                 WHERE e.run_id = r.id AND e.kind IN ({kinds})), 0)
                           AS lost_s
                FROM runs r WHERE r.started_at IS NOT NULL
            ) t"""


EVENT_COLUMNS = ("lost_detection_s", "lost_restart_s", "lost_queue_wait_s", "lost_replay_s")


def upgrade() -> None:
    # Plain ALTER TABLE (no batch copy): SQLite cannot recreate a table the views read.
    for name in EVENT_COLUMNS:
        op.add_column("events", sa.Column(name, sa.Float(), nullable=True))
    op.add_column("events", sa.Column("time_lost_estimate", sa.Boolean(), nullable=True))
    op.add_column("runs", sa.Column("first_step_at", sa.DateTime(), nullable=True))
    op.add_column("runs", sa.Column("last_step_at", sa.DateTime(), nullable=True))
    op.execute("DROP VIEW IF EXISTS run_effective_time")
    for name, body in _views().items():
        op.execute(f"CREATE VIEW {name} AS {body}")


def downgrade() -> None:
    for name in reversed(list(_views())):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.execute(f"CREATE VIEW run_effective_time AS {_old_run_effective_time()}")
    # ALTER TABLE ... DROP COLUMN: PostgreSQL, and SQLite since 3.35 (Debian 12 has 3.40).
    for table, column in (
        ("runs", "last_step_at"),
        ("runs", "first_step_at"),
        ("events", "time_lost_estimate"),
        *(("events", name) for name in reversed(EVENT_COLUMNS)),
    ):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
