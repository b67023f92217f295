"""Writing agent reports into the store in batches.

The shapes here are what the daemon's ingest endpoint hands over: one batch of heartbeats and
step times per agent report. Both writes are idempotent, because agents resend a batch until it is
acknowledged: the latest-heartbeat upsert only moves forward in ``seq``, and step times are unique
per (run, rank, step) through the caller's sequence numbers (the daemon drops a batch it has seen).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Insert, Table, insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from slurmft.db.models import (
    AgentCursor,
    Base,
    RankHeartbeat,
    RankHeartbeatSample,
    StepTime,
    driver_time,
    utcnow,
)

if TYPE_CHECKING:
    import psycopg


def _table(model: type[Base]) -> Table:
    """The model's Table (declarative types ``__table__`` as any FromClause)."""
    return cast(Table, model.__table__)


_HEARTBEAT_UPDATED = (
    "attempt_id",
    "node",
    "phase",
    "step",
    "progress_age_s",
    "deadline_s",
    "seq",
    "sent_at",
    "received_at",
    "sampled_at",
)

# Built once: building a statement costs more than running it for a few rows.
_LATEST = _table(RankHeartbeat)
_RANKS_PER_READ = 500
_SAMPLE_COLUMNS = ("run_id", "rank", "node", "phase", "step", "sent_at")
_STEP_TIME_COLUMNS = (
    "run_id",
    "attempt_id",
    "rank",
    "step",
    "peer_group",
    "compute_s",
    "wait_s",
    "ended_at",
)
_LATEST_COLUMNS = ("run_id", "rank", *_HEARTBEAT_UPDATED)


class _DriverExecutemany:
    """A hot INSERT, compiled once per dialect, run below SQLAlchemy's parameter processing.

    SQLAlchemy's executemany processes every parameter of every row in Python, about 5 µs a row:
    a second of daemon CPU for the ~30,000 rows a 16,384-rank run reports in one poll interval.
    Here the rows come as tuples in ``columns`` order, already in the driver's form (timestamps
    through models.driver_time). SQLite takes them through the driver's executemany. PostgreSQL
    takes them by COPY (psycopg formats the rows in C; its executemany still costs Python per
    row): straight into the table, or for an upsert into a temporary table first, then one
    `INSERT ... SELECT ... ON CONFLICT`."""

    def __init__(self, statement: Callable[[str], Insert], columns: tuple[str, ...]) -> None:
        self._statement = statement
        self.columns = columns
        self._compiled: dict[str, _Compiled] = {}

    def execute(self, session: Session, rows: Sequence[tuple[Any, ...]]) -> None:
        connection = session.connection()
        dialect = connection.dialect
        compiled = self._compiled.get(dialect.name)
        if compiled is None:
            compiled = self._compiled[dialect.name] = self._compile(dialect)
        if compiled.copy_into is None:
            connection.exec_driver_sql(compiled.sql, list(rows))
            return
        if compiled.sql:  # an upsert: per connection; emptied at commit, and below
            connection.exec_driver_sql(
                f"CREATE TEMPORARY TABLE IF NOT EXISTS {compiled.copy_into} "
                f"(LIKE {compiled.table} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
            )
        # COPY is psycopg's own (the postgresql dialect here is psycopg 3).
        dbapi = cast("psycopg.Connection[Any] | None", connection.connection.dbapi_connection)
        assert dbapi is not None
        copy_sql = f"COPY {compiled.copy_into} ({', '.join(self.columns)}) FROM STDIN"
        with dbapi.cursor() as cursor, cursor.copy(copy_sql) as copy:
            for row in rows:
                copy.write_row(row)
        if compiled.sql:
            connection.exec_driver_sql(compiled.sql)
            connection.exec_driver_sql(f"DELETE FROM {compiled.copy_into}")

    def _compile(self, dialect: Dialect) -> _Compiled:
        statement = self._statement(dialect.name)
        table = statement.table.name
        compiled = statement.compile(dialect=dialect, column_keys=list(self.columns))
        if dialect.name != "postgresql":
            assert compiled.positional, dialect.paramstyle  # rows are tuples in our order
            assert tuple(compiled.positiontup or ()) == self.columns, compiled.positiontup
            return _Compiled(table, compiled.string)
        head, values = compiled.string.split(" VALUES (", 1)
        rest = values.split(") ON CONFLICT ", 1)
        if len(rest) == 1:
            return _Compiled(table, "", copy_into=table)  # plain INSERT: COPY into the table
        source = f"slurmft_incoming_{table}"
        upsert = f"{head} SELECT {', '.join(self.columns)} FROM {source} ON CONFLICT {rest[1]}"
        return _Compiled(table, upsert, copy_into=source)


@dataclass(frozen=True)
class _Compiled:
    table: str
    sql: str  # run with the rows (executemany); with COPY, run after it (an upsert), or none
    copy_into: str | None = None  # PostgreSQL: the rows go by COPY into this table


@dataclass(frozen=True, slots=True)
class HeartbeatReport:
    rank: int
    node: str
    phase: str
    step: int
    seq: int
    sent_at: datetime
    progress_age_s: float = 0.0
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepTimeReport:
    rank: int
    step: int
    compute_s: float
    wait_s: float
    ended_at: datetime
    peer_group: str = ""


def _dialect_insert(dialect: str, table: Table) -> sqlite.Insert | postgresql.Insert:
    if dialect == "sqlite":
        return sqlite.insert(table)
    if dialect == "postgresql":
        return postgresql.insert(table)
    raise NotImplementedError(f"no upsert for dialect {dialect}")


_NEW_SAMPLES = _DriverExecutemany(lambda _: insert(_table(RankHeartbeatSample)), _SAMPLE_COLUMNS)
_NEW_STEP_TIMES = _DriverExecutemany(lambda _: insert(_table(StepTime)), _STEP_TIME_COLUMNS)


@functools.cache
def _heartbeat_upsert(dialect: str) -> Insert:
    """Built once per dialect: building it costs more than running it for a node's few ranks."""
    table = _table(RankHeartbeat)
    stmt = _dialect_insert(dialect, table)
    excluded = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[table.c.run_id, table.c.rank],
        set_={col: excluded[col] for col in _HEARTBEAT_UPDATED},
        # Resent or reordered batches never move a rank's heartbeat backwards.
        where=excluded.seq > table.c.seq,
    )


@dataclass(frozen=True, slots=True)
class RunReports:
    """One run's share of what is stored in one transaction (one agent batch, or the batches of
    many agents committed together)."""

    run_id: str
    attempt_id: int | None
    heartbeats: Sequence[HeartbeatReport] = ()
    step_times: Sequence[StepTimeReport] = ()


_LATEST_UPSERT = _DriverExecutemany(_heartbeat_upsert, _LATEST_COLUMNS)


@functools.cache
def _cursor_upsert(dialect: str) -> Insert:
    table = _table(AgentCursor)
    stmt = _dialect_insert(dialect, table)
    return stmt.on_conflict_do_update(
        index_elements=[table.c.run_id, table.c.agent_id],
        set_={"last_seq": stmt.excluded.last_seq, "updated_at": stmt.excluded.updated_at},
        where=stmt.excluded.last_seq > table.c.last_seq,  # a cursor never moves back
    )


_CURSOR_UPSERT = _DriverExecutemany(
    _cursor_upsert, ("run_id", "agent_id", "node", "last_seq", "updated_at")
)


def record_agent_cursors(
    session: Session, cursors: Sequence[tuple[str, str, str, int]], at: datetime
) -> None:
    """Move each agent's cursor, (run_id, agent_id, node, last_seq), forward to ``last_seq``
    (created at the agent's first batch): one statement for every agent of a group commit."""
    if cursors:
        when = driver_time(session.get_bind().dialect.name)(at)
        _CURSOR_UPSERT.execute(session, [(*cursor, when) for cursor in cursors])


def record_reports(
    session: Session,
    reports: Sequence[RunReports],
    *,
    sample_every: timedelta = timedelta(seconds=60),
    received_at: datetime | None = None,
) -> int:
    """Store the heartbeats and step times of several runs with one executemany per table.

    Returns the number of heartbeat history samples written.
    """
    when = driver_time(session.get_bind().dialect.name)
    received = when(received_at or utcnow())
    samples: list[tuple[Any, ...]] = []
    latest: list[tuple[Any, ...]] = []
    for run in reports:
        _heartbeat_rows(session, run, sample_every, received, into=(samples, latest))
    if samples:
        _NEW_SAMPLES.execute(session, samples)
    if latest:
        _LATEST_UPSERT.execute(session, latest)
    step_rows = [
        (
            run.run_id,
            run.attempt_id,
            st.rank,
            st.step,
            st.peer_group,
            st.compute_s,
            st.wait_s,
            when(st.ended_at),
        )
        for run in reports
        for st in run.step_times
    ]
    if step_rows:
        _NEW_STEP_TIMES.execute(session, step_rows)
    return len(samples)


def _heartbeat_rows(
    session: Session,
    run: RunReports,
    sample_every: timedelta,
    received_at: Any,
    *,
    into: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]],
) -> None:
    """Append to ``into`` = (samples, latest) the run's newest heartbeat per rank, and, as a
    history sample, those of ranks last sampled at least ``sample_every`` ago."""
    samples, latest = into
    newest: dict[int, HeartbeatReport] = {}
    for hb in run.heartbeats:  # several beats of one rank: the highest seq wins
        known = newest.get(hb.rank)
        if known is None or hb.seq > known.seq:
            newest[hb.rank] = hb
    if not newest:
        return
    last_sampled = _last_sampled(session, run.run_id, list(newest))
    when = driver_time(session.get_bind().dialect.name)
    for rank, hb in newest.items():
        # Compared in the driver's form (SQLite: text that sorts in time order), as read.
        previous = last_sampled.get(rank)
        sent_at = when(hb.sent_at)
        sampled = previous is None or previous <= when(hb.sent_at - sample_every)
        if sampled:
            samples.append((run.run_id, rank, hb.node, hb.phase, hb.step, sent_at))
        latest.append(
            (
                run.run_id,
                rank,
                run.attempt_id,
                hb.node,
                hb.phase,
                hb.step,
                hb.progress_age_s,
                hb.deadline_s,
                hb.seq,
                sent_at,
                received_at,
                sent_at if sampled else previous,
            )
        )


def _last_sampled(session: Session, run_id: str, ranks: list[int]) -> dict[int, Any]:
    """The ranks' last sample times, in the driver's form (see _DriverExecutemany). One group
    commit holds the ranks of many agents of a run, anywhere in the run's rank range."""
    connection = session.connection()
    found: dict[int, Any] = {}
    if connection.dialect.name == "postgresql":
        # A join with the array, not IN (...): PostgreSQL runs a long IN list of parameters as
        # a filter over every row of the run (measured: 50 ms for 500 of 16,384 ranks).
        rows = connection.exec_driver_sql(
            f"SELECT h.rank, h.sampled_at FROM {_LATEST.name} AS h "
            "JOIN unnest(%s::integer[]) AS wanted(rank) ON h.rank = wanted.rank "
            "WHERE h.run_id = %s",
            (ranks, run_id),
        )
        found.update((rank, at) for rank, at in rows)
        return found
    for first in range(0, len(ranks), _RANKS_PER_READ):
        chunk = ranks[first : first + _RANKS_PER_READ]
        sql = (
            f"SELECT rank, sampled_at FROM {_LATEST.name} "
            f"WHERE run_id = ? AND rank IN ({', '.join('?' * len(chunk))})"
        )
        found.update((rank, at) for rank, at in connection.exec_driver_sql(sql, (run_id, *chunk)))
    return found


def record_heartbeats(
    session: Session,
    run_id: str,
    attempt_id: int | None,
    heartbeats: Sequence[HeartbeatReport],
    *,
    sample_every: timedelta = timedelta(seconds=60),
    received_at: datetime | None = None,
) -> int:
    """Keep the newest heartbeat per rank and sample at most one per rank per ``sample_every``.

    Returns the number of history samples written.
    """
    run = RunReports(run_id, attempt_id, heartbeats=heartbeats)
    return record_reports(session, [run], sample_every=sample_every, received_at=received_at)


def record_step_times(
    session: Session,
    run_id: str,
    attempt_id: int | None,
    step_times: Sequence[StepTimeReport],
) -> int:
    """Append raw step times (one executemany); returns the number of rows written."""
    record_reports(session, [RunReports(run_id, attempt_id, step_times=step_times)])
    return len(step_times)
