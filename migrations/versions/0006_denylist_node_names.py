"""Denylist entries whose node is not a Slurm node name are retired, not deleted.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 16:00:00

Every exclude list slurmft gives sbatch and scontrol is built from the denylist, so one entry
whose name is not a node name (an agent once posted it as a GPU fault's node) made every later
submit, requeue and resubmission fail, for every user. New entries are checked on write
(slurmft.slurm.names); the active ones written before are ended here: ``removed_at`` set and
the reason kept, with why appended, so nothing is lost. The rule is frozen here as it stood
at this revision, as 0002 freezes its SQL. Downgrading makes those entries active again.
"""

import re
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
MARK = " [retired by migration 0006: not a valid Slurm node name]"

_denylist = sa.table(
    "node_denylist",
    sa.column("id", sa.BigInteger),
    sa.column("node", sa.String),
    sa.column("reason", sa.Text),
    sa.column("removed_at", sa.DateTime),
)


def upgrade() -> None:
    conn = op.get_bind()
    now = datetime.now(UTC).replace(tzinfo=None)  # stored as naive UTC (UTCDateTime)
    active = conn.execute(
        sa.select(_denylist.c.id, _denylist.c.node, _denylist.c.reason).where(
            _denylist.c.removed_at.is_(None)
        )
    ).all()
    for entry_id, node, reason in active:
        if node is not None and _NODE_NAME.fullmatch(node):
            continue
        conn.execute(
            _denylist.update()
            .where(_denylist.c.id == entry_id)
            .values(removed_at=now, reason=(reason or "") + MARK)
        )


def downgrade() -> None:
    conn = op.get_bind()
    retired = conn.execute(
        sa.select(_denylist.c.id, _denylist.c.reason).where(_denylist.c.reason.endswith(MARK))
    ).all()
    for entry_id, reason in retired:
        conn.execute(
            _denylist.update()
            .where(_denylist.c.id == entry_id)
            .values(removed_at=None, reason=reason.removesuffix(MARK))
        )
