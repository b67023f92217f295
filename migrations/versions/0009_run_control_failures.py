"""A run whose part of the control pass keeps failing is held: `runs.control_failures`.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 23:30:00

Each run is observed, decided and acted on in isolation: a failure in one run's part of a pass
is recorded on that run and the pass goes on for the others (slurmft.controller.pass_health).
`control_failures` counts the passes in a row in which the run's part failed; at
`pass_health.HOLD_AFTER` the run is held (its part is no longer tried, `slurmft status`,
`/healthz` and a metric say so) until an admin releases it. `control_error` is the newest
failure's summary, for those readers.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("control_failures", sa.Integer(), nullable=False, server_default="0"),
    )
    op.add_column("runs", sa.Column("control_error", sa.Text(), nullable=True))


def downgrade() -> None:
    # SQLite (>= 3.35) drops a column in place; Alembic's batch mode would copy the table,
    # which the failure-history views that read `runs` refuse.
    op.execute("ALTER TABLE runs DROP COLUMN control_error")
    op.execute("ALTER TABLE runs DROP COLUMN control_failures")
