"""Evidence is judged against the attempt's allocation: `events.foreign`.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 16:00:00

An agent's event that names a node outside its attempt's allocation (the nodes Slurm gave the
job, as the batch step reported and the daemon checked) is stored with `foreign` true and never
acted on; NULL means not judged yet (the allocation is not known), and such evidence is held.
The daemon's own events are its own evidence: false. Agent events stored before this revision
stay NULL: nothing was checked when they came, so they are never acted on.

The two views that rank nodes (`failures_by_node`, `node_lemons`) leave foreign evidence out: one
run's word on a node it never held is no failure of that node. Their SQL is frozen here, as in
0002, with that one condition added.

`foreign` is a reserved word in SQL: it is quoted wherever it is written.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


FAILURE_KINDS = (
    "'rank_failure', 'node_lost', 'gpu_fault', 'hang', 'straggler', 'batch_host_down', "
    "'preflight_failed'"
)
_NODE_VIEWS = {
    "failures_by_node": """
            SELECT e.node AS node, e.kind AS kind,
                   COALESCE(e.fault_class, 'unknown') AS fault_class, e.xid AS xid,
                   COUNT(*) AS failures, COUNT(DISTINCT e.run_id) AS runs,
                   MIN(e.occurred_at) AS first_at, MAX(e.occurred_at) AS last_at
            FROM events e
            WHERE e.node IS NOT NULL AND e.kind IN ({kinds}){own}
            GROUP BY e.node, e.kind, COALESCE(e.fault_class, 'unknown'), e.xid""",
    "node_lemons": """
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
            WHERE e.node IS NOT NULL AND e.kind IN ({kinds}){own}
            GROUP BY e.node""",
}


def _replace_node_views(own: str) -> None:
    for name, body in _NODE_VIEWS.items():
        op.execute(f"DROP VIEW IF EXISTS {name}")
        op.execute(f"CREATE VIEW {name} AS {body.format(kinds=FAILURE_KINDS, own=own)}")


def upgrade() -> None:
    op.add_column("events", sa.Column("foreign", sa.Boolean(), nullable=True))
    events = sa.table("events", sa.column("source", sa.String), sa.column("foreign", sa.Boolean))
    op.execute(events.update().where(events.c.source != "agent").values(foreign=False))
    _replace_node_views(' AND e."foreign" IS NOT TRUE')


def downgrade() -> None:
    _replace_node_views("")  # as 0002 made them: they must not read the column dropped below
    if op.get_bind().dialect.name == "sqlite":
        # SQLite (>= 3.35) drops a column in place; Alembic's batch mode would copy the table,
        # which the failure-history views that read `events` refuse.
        op.execute('ALTER TABLE events DROP COLUMN "foreign"')
        return
    op.drop_column("events", "foreign")
