"""The job as it was submitted, kept with its run so a resubmission is the same job.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 14:20:00

A run whose job cannot be requeued (it ended on its time limit, or preemption cancelled it) is
resubmitted by the daemon as the run's owner. `slurmft submit` built that job on the user's side
(its script carries the user's slurmft, environment and token file), so the daemon keeps what
was sent to sbatch rather than rebuilding it from the spec.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("submission", sa.JSON(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite (>= 3.35) drops a column in place; Alembic's batch mode would copy the table,
        # which the failure-history views that read `runs` refuse.
        op.execute("ALTER TABLE runs DROP COLUMN submission")
        return
    op.drop_column("runs", "submission")
