"""Evidence is judged against the attempt's allocation: `events.foreign`.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 16:00:00

An agent's event that names a node outside its attempt's allocation (the nodes Slurm gave the
job, as the batch step reported and the daemon checked) is stored with `foreign` true and never
acted on; NULL means not judged yet (the allocation is not known), and such evidence is held.
The daemon's own events are its own evidence: false. Agent events stored before this revision
stay NULL: nothing was checked when they came, so they are never acted on.

`foreign` is a reserved word in SQL: the statements here are built, so the name is quoted.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("events", sa.Column("foreign", sa.Boolean(), nullable=True))
    events = sa.table("events", sa.column("source", sa.String), sa.column("foreign", sa.Boolean))
    op.execute(events.update().where(events.c.source != "agent").values(foreign=False))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite (>= 3.35) drops a column in place; Alembic's batch mode would copy the table,
        # which the failure-history views that read `events` refuse.
        op.execute('ALTER TABLE events DROP COLUMN "foreign"')
        return
    op.drop_column("events", "foreign")
