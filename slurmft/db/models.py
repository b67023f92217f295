"""Typed SQLAlchemy 2 models of the store.

Volume decides the shape: ``step_times`` and ``rank_heartbeat_samples`` are raw and bounded by
retention (16k ranks at a step a second is over a billion rows a day); ``step_time_minutes``,
``events`` and ``actions`` are kept for good. Enums are stored as their string values without a
CHECK constraint, so adding a member needs no migration.
"""

from __future__ import annotations

import enum
import functools
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, validates

# The vocabulary lives in slurmft.core (the store maps it); the names stay importable from here
# (`X as X`: an explicit re-export, which the type checker requires).
from slurmft.core.kinds import ActionKind as ActionKind
from slurmft.core.kinds import ActionStatus as ActionStatus
from slurmft.core.kinds import EventKind as EventKind
from slurmft.core.kinds import FaultClass as FaultClass
from slurmft.core.kinds import NodeRole as NodeRole
from slurmft.core.states import (
    ATTEMPT_TRANSITIONS,
    RUN_TRANSITIONS,
    AttemptState,
    RunState,
    check_transition,
)

# Stable constraint names on SQLite and PostgreSQL, so migrations can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit key.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps stored as naive UTC (portable across SQLite and PostgreSQL), read back aware."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware UTC datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)

    def bind_processor(self, dialect: Dialect) -> Callable[[datetime | None], Any] | None:
        if dialect.name != "sqlite":
            return super().bind_processor(dialect)
        to_text = driver_time(dialect.name)
        return lambda value: None if value is None else to_text(value)


@functools.cache
def driver_time(dialect_name: str) -> Callable[[datetime], Any]:
    """An aware timestamp as the driver takes it for a UTCDateTime column, for statements run
    below SQLAlchemy's parameter processing (db.ingest's hot inserts).

    SQLite stores text. SQLAlchemy's DATETIME formats it through a dict and `%`; the daemon
    binds ~50,000 timestamps a second for a 16,384-rank run, and isoformat is the same text
    ("YYYY-MM-DD HH:MM:SS.ffffff", microseconds always) at a third of the cost."""
    as_naive_utc = UTCDateTime().process_bind_param

    def naive(value: datetime) -> datetime:
        converted = as_naive_utc(value, None)
        assert converted is not None
        return converted

    if dialect_name == "sqlite":

        def text(value: datetime) -> str:
            if value.tzinfo is UTC:  # the usual case: "...ffffff+00:00" less the offset
                return value.isoformat(" ", "microseconds")[:26]
            return naive(value).isoformat(" ", "microseconds")

        return text
    return naive


def _enum(cls: type[enum.Enum], length: int = 32) -> Enum:
    return Enum(
        cls,
        native_enum=False,
        create_constraint=False,
        length=length,
        values_callable=lambda members: [m.value for m in members],
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[str]: JSON(),
    }


def new_run_id() -> str:
    return "r" + secrets.token_hex(6)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_run_id)
    name: Mapped[str] = mapped_column(String(200))
    owner_uid: Mapped[int]
    owner_name: Mapped[str] = mapped_column(String(64))
    state: Mapped[RunState] = mapped_column(_enum(RunState), default=RunState.PENDING, index=True)
    nodes: Mapped[int]
    spares: Mapped[int] = mapped_column(default=0)
    command: Mapped[list[str]]
    # What `slurmft submit` was given (nodes, spares, time limit, partition, ...).
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # The job as `slurmft submit` sent it to sbatch (script, options, working directory; see
    # slurmft.controller.resubmit): a resubmission is that same job, as the run's owner.
    submission: Mapped[dict[str, Any] | None]
    checkpoint_dir: Mapped[str | None] = mapped_column(Text)
    token_hash: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    end_reason: Mapped[str | None] = mapped_column(Text)
    last_progress_at: Mapped[datetime | None]
    # The start of its first step and the end of its newest (controller.goodput_pass): the span
    # the effective ratio is taken over.
    first_step_at: Mapped[datetime | None]
    last_step_at: Mapped[datetime | None]
    restarts_without_progress: Mapped[int] = mapped_column(default=0)
    # Set when the owner asks to cancel; the controller cancels the job and ends the run.
    cancel_requested_at: Mapped[datetime | None]
    # Passes in a row in which this run's part of the control pass failed, and the newest
    # failure; held at controller.pass_health.HOLD_AFTER until an admin releases it.
    control_failures: Mapped[int] = mapped_column(default=0, server_default="0")
    control_error: Mapped[str | None] = mapped_column(Text)

    attempts: Mapped[list[Attempt]] = relationship(
        back_populates="run", order_by="Attempt.number", cascade="all, delete-orphan"
    )

    @validates("state")
    def _check_state(self, _key: str, new: RunState) -> RunState:
        check_transition(self.state, RunState(new), RUN_TRANSITIONS)
        return RunState(new)


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int]
    slurm_job_id: Mapped[str | None] = mapped_column(String(32), index=True)
    # Slurm's Restarts count for the job when this attempt began: a higher count is a requeue.
    slurm_restarts: Mapped[int] = mapped_column(default=0)
    state: Mapped[AttemptState] = mapped_column(_enum(AttemptState), default=AttemptState.SUBMITTED)
    nodelist: Mapped[str | None] = mapped_column(Text)
    batch_host: Mapped[str | None] = mapped_column(String(128))
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    end_reason: Mapped[str | None] = mapped_column(Text)
    failure_class: Mapped[FaultClass | None] = mapped_column(_enum(FaultClass))

    run: Mapped[Run] = relationship(back_populates="attempts")
    nodes: Mapped[list[AllocationNode]] = relationship(
        back_populates="attempt", cascade="all, delete-orphan"
    )

    @validates("state")
    def _check_state(self, _key: str, new: AttemptState) -> AttemptState:
        check_transition(self.state, AttemptState(new), ATTEMPT_TRANSITIONS)
        return AttemptState(new)


class AllocationNode(Base):
    """A node of an attempt's allocation: training (active) or warm spare."""

    __tablename__ = "allocation_nodes"
    __table_args__ = (UniqueConstraint("attempt_id", "node"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(128), index=True)
    role: Mapped[NodeRole] = mapped_column(_enum(NodeRole, 16))
    joined_at: Mapped[datetime] = mapped_column(default=utcnow)
    left_at: Mapped[datetime | None]
    left_reason: Mapped[str | None] = mapped_column(Text)

    attempt: Mapped[Attempt] = relationship(back_populates="nodes")


class RankHeartbeat(Base):
    """The latest heartbeat of each rank of a run (one row per rank, updated in place)."""

    __tablename__ = "rank_heartbeats"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="SET NULL"))
    node: Mapped[str] = mapped_column(String(128))
    phase: Mapped[str] = mapped_column(String(32))
    step: Mapped[int]
    # As the rank reported them: time without progress in its phase, and that phase's deadline
    # (a long checkpoint is "checkpoint, 9 min in, deadline 30 min", not silence).
    progress_age_s: Mapped[float] = mapped_column(Float, default=0.0)
    deadline_s: Mapped[float | None] = mapped_column(Float)
    seq: Mapped[int] = mapped_column(BigInteger)
    sent_at: Mapped[datetime]
    received_at: Mapped[datetime] = mapped_column(default=utcnow)
    # When this rank last went into the sampled history; bounds the history's growth.
    sampled_at: Mapped[datetime | None]


class RankHeartbeatSample(Base):
    """Sampled heartbeat history (bounded by retention.heartbeat_history_hours)."""

    __tablename__ = "rank_heartbeat_samples"
    __table_args__ = (
        Index("ix_rank_heartbeat_samples_run_rank_sent", "run_id", "rank", "sent_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int]
    node: Mapped[str] = mapped_column(String(128))
    phase: Mapped[str] = mapped_column(String(32))
    step: Mapped[int]
    sent_at: Mapped[datetime] = mapped_column(index=True)


class StepTime(Base):
    """One rank's time for one step: own compute and collective wait kept apart (raw, bounded)."""

    __tablename__ = "step_times"
    __table_args__ = (
        Index("ix_step_times_run_step", "run_id", "step"),
        # Retention folds old rows per run and minute.
        Index("ix_step_times_run_ended", "run_id", "ended_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="SET NULL"))
    rank: Mapped[int]
    step: Mapped[int]
    peer_group: Mapped[str] = mapped_column(String(64), default="")
    compute_s: Mapped[float] = mapped_column(Float)
    wait_s: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[datetime]


class StepTimeMinute(Base):
    """Per-rank per-minute aggregate of step times (kept for good)."""

    __tablename__ = "step_time_minutes"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True)
    minute: Mapped[datetime] = mapped_column(primary_key=True)
    peer_group: Mapped[str] = mapped_column(String(64), default="")
    steps: Mapped[int]
    first_step: Mapped[int]
    last_step: Mapped[int]
    compute_median_s: Mapped[float] = mapped_column(Float)
    compute_p95_s: Mapped[float] = mapped_column(Float)
    compute_total_s: Mapped[float] = mapped_column(Float)
    wait_median_s: Mapped[float] = mapped_column(Float)
    wait_p95_s: Mapped[float] = mapped_column(Float)
    wait_total_s: Mapped[float] = mapped_column(Float)


class Event(Base):
    """Something that happened: a failure, a fault, a hang, a straggler, a restart, progress."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_occurred", "run_id", "occurred_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="SET NULL"))
    kind: Mapped[EventKind] = mapped_column(_enum(EventKind), index=True)
    fault_class: Mapped[FaultClass | None] = mapped_column(_enum(FaultClass))
    node: Mapped[str | None] = mapped_column(String(128), index=True)
    rank: Mapped[int | None]
    gpu_index: Mapped[int | None]
    xid: Mapped[int | None]
    message: Mapped[str] = mapped_column(Text, default="")
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Training time this failure cost (slurmft.core.goodput), and its parts by cause; set once
    # training is back past the failure (NULL until then). The first report of an outage holds
    # its cost; the other reports of the same outage hold 0.
    time_lost_s: Mapped[float | None] = mapped_column(Float)
    lost_detection_s: Mapped[float | None] = mapped_column(Float)
    lost_restart_s: Mapped[float | None] = mapped_column(Float)
    lost_queue_wait_s: Mapped[float | None] = mapped_column(Float)
    lost_replay_s: Mapped[float | None] = mapped_column(Float)
    # True: estimated from observable times (a script that reports no steps), not measured.
    time_lost_estimate: Mapped[bool | None]
    source: Mapped[str] = mapped_column(String(32), default="daemon")
    # An agent's evidence is judged against its attempt's allocation (slurmft.controller
    # .allocation): true when it names a node (or a job) that is not the run's own, and then it
    # is never acted on; NULL until the allocation is known (held). The daemon's own: false.
    foreign: Mapped[bool | None]
    occurred_at: Mapped[datetime] = mapped_column(default=utcnow)
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)


class Action(Base):
    """Everything the controller does (or decided but did not do), with reason and evidence."""

    __tablename__ = "actions"
    __table_args__ = (Index("ix_actions_run_created", "run_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="SET NULL"))
    event_id: Mapped[int | None] = mapped_column(ForeignKey("events.id", ondelete="SET NULL"))
    kind: Mapped[ActionKind] = mapped_column(_enum(ActionKind))
    node: Mapped[str | None] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[ActionStatus] = mapped_column(
        _enum(ActionStatus, 16), default=ActionStatus.PLANNED
    )
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class AgentCursor(Base):
    """The newest batch acknowledged per agent: agents resend until acknowledged, so a batch
    with a sequence number at or below this one is a duplicate and is not written again."""

    __tablename__ = "agent_cursors"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    agent_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    node: Mapped[str] = mapped_column(String(128))
    last_seq: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class DenylistEntry(Base):
    """A node kept out: of one run (``run_id`` set) or of every run (``run_id`` NULL)."""

    __tablename__ = "node_denylist"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(128), index=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    reason: Mapped[str] = mapped_column(Text)
    action_id: Mapped[int | None] = mapped_column(ForeignKey("actions.id", ondelete="SET NULL"))
    added_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    removed_at: Mapped[datetime | None]
