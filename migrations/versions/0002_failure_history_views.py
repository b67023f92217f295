"""Failure-history views: the questions operators ask, as plain SQL over the store.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 11:10:00

The SQL is frozen here (not imported from the package) so that this revision means the same thing
forever. Durations are seconds; the one dialect difference is turning a timestamp into epoch
seconds. Timestamps are stored as naive UTC.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FAILURE_KINDS = (
    "'rank_failure', 'node_lost', 'gpu_fault', 'hang', 'straggler', 'batch_host_down', "
    "'preflight_failed'"
)


def _epoch(expr: str) -> str:
    if op.get_bind().dialect.name == "sqlite":
        return f"((julianday({expr}) - 2440587.5) * 86400.0)"
    return f"EXTRACT(EPOCH FROM {expr})"


def _views() -> dict[str, str]:
    now = _epoch("CURRENT_TIMESTAMP")
    return {
        # One row per node, failure kind, fault class and Xid.
        "failures_by_node": f"""
            SELECT e.node AS node, e.kind AS kind,
                   COALESCE(e.fault_class, 'unknown') AS fault_class, e.xid AS xid,
                   COUNT(*) AS failures, COUNT(DISTINCT e.run_id) AS runs,
                   MIN(e.occurred_at) AS first_at, MAX(e.occurred_at) AS last_at
            FROM events e
            WHERE e.node IS NOT NULL AND e.kind IN ({FAILURE_KINDS})
            GROUP BY e.node, e.kind, COALESCE(e.fault_class, 'unknown'), e.xid""",
        # One row per fault class and Xid, across all nodes.
        "failures_by_class": f"""
            SELECT COALESCE(e.fault_class, 'unknown') AS fault_class, e.kind AS kind,
                   e.xid AS xid, COUNT(*) AS failures, COUNT(DISTINCT e.node) AS nodes,
                   COUNT(DISTINCT e.run_id) AS runs,
                   COALESCE(SUM(e.time_lost_s), 0) AS time_lost_s
            FROM events e
            WHERE e.kind IN ({FAILURE_KINDS})
            GROUP BY COALESCE(e.fault_class, 'unknown'), e.kind, e.xid""",
        # One row per run (runs without failures too), with the training time they cost.
        "run_failures": f"""
            SELECT r.id AS run_id, r.name AS name, r.state AS state,
                   COUNT(e.id) AS failures,
                   COALESCE(SUM(e.time_lost_s), 0) AS time_lost_s,
                   MIN(e.occurred_at) AS first_failure_at, MAX(e.occurred_at) AS last_failure_at
            FROM runs r
            LEFT JOIN events e ON e.run_id = r.id AND e.kind IN ({FAILURE_KINDS})
            GROUP BY r.id, r.name, r.state""",
        # One row per run: restarts in all and per failure class, and Slurm attempts.
        "run_restarts": """
            SELECT r.id AS run_id, r.name AS name, r.state AS state,
                   COALESCE(x.restarts, 0) AS restarts,
                   COALESCE(x.hardware, 0) AS hardware,
                   COALESCE(x.hang, 0) AS hang,
                   COALESCE(x.straggler, 0) AS straggler,
                   COALESCE(x.user_code, 0) AS user_code,
                   COALESCE(x.preemption, 0) AS preemption,
                   COALESCE(x.other, 0) AS other,
                   (SELECT COUNT(*) FROM attempts a WHERE a.run_id = r.id) AS attempts
            FROM runs r
            LEFT JOIN (
                SELECT run_id, COUNT(*) AS restarts,
                       SUM(CASE WHEN fault_class = 'hardware' THEN 1 ELSE 0 END) AS hardware,
                       SUM(CASE WHEN fault_class = 'hang' THEN 1 ELSE 0 END) AS hang,
                       SUM(CASE WHEN fault_class = 'straggler' THEN 1 ELSE 0 END) AS straggler,
                       SUM(CASE WHEN fault_class = 'user_code' THEN 1 ELSE 0 END) AS user_code,
                       SUM(CASE WHEN fault_class IN ('preemption', 'time_limit')
                                THEN 1 ELSE 0 END) AS preemption,
                       SUM(CASE WHEN fault_class IS NULL OR fault_class NOT IN
                                ('hardware', 'hang', 'straggler', 'user_code', 'preemption',
                                 'time_limit') THEN 1 ELSE 0 END) AS other
                FROM events WHERE kind = 'restart' GROUP BY run_id
            ) x ON x.run_id = r.id""",
        # Nodes ranked by failures: the lemons first. `denylisted` means kept out of every run.
        "node_lemons": f"""
            SELECT e.node AS node,
                   RANK() OVER (ORDER BY COUNT(*) DESC) AS position,
                   COUNT(*) AS failures,
                   SUM(CASE WHEN e.fault_class = 'hardware' THEN 1 ELSE 0 END)
                       AS hardware_failures,
                   COUNT(DISTINCT e.run_id) AS runs,
                   MAX(e.occurred_at) AS last_failure_at,
                   CASE WHEN EXISTS (
                       SELECT 1 FROM node_denylist d
                       WHERE d.node = e.node AND d.run_id IS NULL AND d.removed_at IS NULL
                   ) THEN 1 ELSE 0 END AS denylisted
            FROM events e
            WHERE e.node IS NOT NULL AND e.kind IN ({FAILURE_KINDS})
            GROUP BY e.node""",
        # Effective training time: wall time since the run started minus time lost to failures.
        "run_effective_time": f"""
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
                                 WHERE e.run_id = r.id AND e.kind IN ({FAILURE_KINDS})), 0)
                           AS lost_s
                FROM runs r WHERE r.started_at IS NOT NULL
            ) t""",
    }


def upgrade() -> None:
    for name, body in _views().items():
        op.execute(f"CREATE VIEW {name} AS {body}")


def downgrade() -> None:
    for name in reversed(list(_views())):
        op.execute(f"DROP VIEW IF EXISTS {name}")
