"""Initial schema: runs, attempts, nodes, heartbeats, step times, events, actions, denylist.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 11:06:04.083771
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("owner_uid", sa.Integer(), nullable=False),
        sa.Column("owner_name", sa.String(length=64), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "pending",
                "running",
                "recovering",
                "completed",
                "failed",
                "cancelled",
                "stopped",
                name="runstate",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("spares", sa.Integer(), nullable=False),
        sa.Column("command", sa.JSON(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("checkpoint_dir", sa.Text(), nullable=True),
        sa.Column("token_hash", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("end_reason", sa.Text(), nullable=True),
        sa.Column("last_progress_at", sa.DateTime(), nullable=True),
        sa.Column("restarts_without_progress", sa.Integer(), nullable=False),
        sa.Column("cancel_requested_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_state"), ["state"], unique=False)

    op.create_table(
        "attempts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("slurm_job_id", sa.String(length=32), nullable=True),
        sa.Column("slurm_restarts", sa.Integer(), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "submitted",
                "running",
                "completed",
                "failed",
                "node_fail",
                "timeout",
                "preempted",
                "cancelled",
                "requeued",
                "lost",
                name="attemptstate",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("nodelist", sa.Text(), nullable=True),
        sa.Column("batch_host", sa.String(length=128), nullable=True),
        sa.Column("submitted_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("end_reason", sa.Text(), nullable=True),
        sa.Column(
            "failure_class",
            sa.Enum(
                "hardware",
                "hang",
                "straggler",
                "user_code",
                "preemption",
                "time_limit",
                "infrastructure",
                "unknown",
                name="faultclass",
                native_enum=False,
                length=32,
            ),
            nullable=True,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("run_id", "number", name=op.f("uq_attempts_run_id_number")),
    )
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attempts_run_id"), ["run_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_attempts_slurm_job_id"), ["slurm_job_id"], unique=False
        )

    op.create_table(
        "rank_heartbeat_samples",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("phase", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("sent_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_rank_heartbeat_samples_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rank_heartbeat_samples")),
    )
    with op.batch_alter_table("rank_heartbeat_samples", schema=None) as batch_op:
        batch_op.create_index(
            "ix_rank_heartbeat_samples_run_rank_sent", ["run_id", "rank", "sent_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_rank_heartbeat_samples_sent_at"), ["sent_at"], unique=False
        )

    op.create_table(
        "step_time_minutes",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("minute", sa.DateTime(), nullable=False),
        sa.Column("peer_group", sa.String(length=64), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=False),
        sa.Column("compute_median_s", sa.Float(), nullable=False),
        sa.Column("compute_p95_s", sa.Float(), nullable=False),
        sa.Column("compute_total_s", sa.Float(), nullable=False),
        sa.Column("wait_median_s", sa.Float(), nullable=False),
        sa.Column("wait_p95_s", sa.Float(), nullable=False),
        sa.Column("wait_total_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_step_time_minutes_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", "minute", name=op.f("pk_step_time_minutes")),
    )
    op.create_table(
        "allocation_nodes",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column(
            "role",
            sa.Enum("active", "spare", name="noderole", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("joined_at", sa.DateTime(), nullable=False),
        sa.Column("left_at", sa.DateTime(), nullable=True),
        sa.Column("left_reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_allocation_nodes_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocation_nodes")),
        sa.UniqueConstraint("attempt_id", "node", name=op.f("uq_allocation_nodes_attempt_id_node")),
    )
    with op.batch_alter_table("allocation_nodes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_allocation_nodes_node"), ["node"], unique=False)

    op.create_table(
        "events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=32), nullable=True),
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column(
            "kind",
            sa.Enum(
                "rank_failure",
                "node_lost",
                "gpu_fault",
                "hang",
                "straggler",
                "batch_host_down",
                "preflight_failed",
                "channel_silent",
                "preempted",
                "time_limit",
                "restart",
                "checkpoint",
                name="eventkind",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column(
            "fault_class",
            sa.Enum(
                "hardware",
                "hang",
                "straggler",
                "user_code",
                "preemption",
                "time_limit",
                "infrastructure",
                "unknown",
                name="faultclass",
                native_enum=False,
                length=32,
            ),
            nullable=True,
        ),
        sa.Column("node", sa.String(length=128), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("gpu_index", sa.Integer(), nullable=True),
        sa.Column("xid", sa.Integer(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("time_lost_s", sa.Float(), nullable=True),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("occurred_at", sa.DateTime(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_events_attempt_id_attempts"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_kind"), ["kind"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_node"), ["node"], unique=False)
        batch_op.create_index("ix_events_run_occurred", ["run_id", "occurred_at"], unique=False)

    op.create_table(
        "rank_heartbeats",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("phase", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("progress_age_s", sa.Float(), nullable=False),
        sa.Column("deadline_s", sa.Float(), nullable=True),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("sent_at", sa.DateTime(), nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("sampled_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_rank_heartbeats_attempt_id_attempts"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rank_heartbeats_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_rank_heartbeats")),
    )
    op.create_table(
        "step_times",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("peer_group", sa.String(length=64), nullable=False),
        sa.Column("compute_s", sa.Float(), nullable=False),
        sa.Column("wait_s", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_step_times_attempt_id_attempts"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_step_times_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_times")),
    )
    with op.batch_alter_table("step_times", schema=None) as batch_op:
        batch_op.create_index("ix_step_times_run_ended", ["run_id", "ended_at"], unique=False)
        batch_op.create_index("ix_step_times_run_step", ["run_id", "step"], unique=False)

    op.create_table(
        "actions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=32), nullable=True),
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column(
            "kind",
            sa.Enum(
                "submit",
                "drain_node",
                "resume_node",
                "down_node",
                "evict_node",
                "agent_leave",
                "requeue",
                "resubmit",
                "cancel",
                "signal",
                "stop_run",
                "denylist_add",
                "denylist_remove",
                name="actionkind",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("node", sa.String(length=128), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "planned",
                "done",
                "failed",
                "skipped",
                name="actionstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_actions_attempt_id_attempts"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["events.id"],
            name=op.f("fk_actions_event_id_events"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_actions_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_actions")),
    )
    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.create_index("ix_actions_run_created", ["run_id", "created_at"], unique=False)

    op.create_table(
        "agent_cursors",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("agent_id", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_agent_cursors_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "agent_id", name=op.f("pk_agent_cursors")),
    )
    op.create_table(
        "node_denylist",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("action_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("added_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.Column("removed_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["action_id"],
            ["actions.id"],
            name=op.f("fk_node_denylist_action_id_actions"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_node_denylist_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_denylist")),
    )
    with op.batch_alter_table("node_denylist", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_node_denylist_node"), ["node"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("node_denylist", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_node_denylist_node"))

    op.drop_table("node_denylist")
    op.drop_table("agent_cursors")
    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.drop_index("ix_actions_run_created")

    op.drop_table("actions")
    with op.batch_alter_table("step_times", schema=None) as batch_op:
        batch_op.drop_index("ix_step_times_run_step")
        batch_op.drop_index("ix_step_times_run_ended")

    op.drop_table("step_times")
    op.drop_table("rank_heartbeats")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_run_occurred")
        batch_op.drop_index(batch_op.f("ix_events_node"))
        batch_op.drop_index(batch_op.f("ix_events_kind"))

    op.drop_table("events")
    with op.batch_alter_table("allocation_nodes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_allocation_nodes_node"))

    op.drop_table("allocation_nodes")
    op.drop_table("step_time_minutes")
    with op.batch_alter_table("rank_heartbeat_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rank_heartbeat_samples_sent_at"))
        batch_op.drop_index("ix_rank_heartbeat_samples_run_rank_sent")

    op.drop_table("rank_heartbeat_samples")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attempts_slurm_job_id"))
        batch_op.drop_index(batch_op.f("ix_attempts_run_id"))

    op.drop_table("attempts")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_state"))

    op.drop_table("runs")
