"""`run_restarts` counts the daemon's one event per restart, not the agents' reports of it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 22:00:00

Every agent taking part in a restart reports it (one `restart` event per node, without a fault
class), so counting all `restart` events gave nodes x restarts under `other`. The daemon now
records one `restart` event per restart it counts, with its cause as the fault class
(slurmft.controller.reconcile); the view counts those. The SQL is frozen here, as in 0002.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_RUN_RESTARTS = """
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
        FROM events WHERE kind = 'restart' AND {where} GROUP BY run_id
    ) x ON x.run_id = r.id"""


def _replace(where: str) -> None:
    op.execute("DROP VIEW IF EXISTS run_restarts")
    op.execute(f"CREATE VIEW run_restarts AS {_RUN_RESTARTS.format(where=where)}")


def upgrade() -> None:
    _replace("source = 'daemon'")


def downgrade() -> None:
    _replace("1 = 1")
