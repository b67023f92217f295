from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import func, inspect, select

from slurmft.db import Database, SchemaOutOfDate
from slurmft.db.database import migrations_dir
from slurmft.db.history import HISTORY_VIEWS, read_view
from slurmft.db.models import Base, DenylistEntry, Event, EventKind, FaultClass, Run
from slurmft.db.records import denied_nodes
from slurmft.db.states import RunState


def test_exactly_one_migration_head() -> None:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    assert len(ScriptDirectory.from_config(cfg).get_heads()) == 1


def test_migrations_match_the_models(database: Database) -> None:
    with database.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def _seed(database: Database) -> None:
    with database.session() as s:
        run = Run(id="rkeep", name="keep", owner_uid=1000, owner_name="alice", nodes=2,
                  command=["python", "train.py"], state=RunState.PENDING)
        s.add(run)
        s.flush()
        run.state = RunState.RUNNING
        run.started_at = datetime(2026, 11, 1, tzinfo=UTC)
        s.add(Event(run_id="rkeep", kind=EventKind.NODE_LOST, node="n3",
                    fault_class=FaultClass.HARDWARE, time_lost_s=30.0))


def _names(database: Database) -> tuple[set[str], set[str]]:
    inspector = inspect(database.engine)
    return set(inspector.get_table_names()), set(inspector.get_view_names())


def test_upgrade_downgrade_upgrade_keeps_data(database: Database) -> None:
    _seed(database)
    head = database.head_revision()

    database.downgrade("0001")  # drop the views and newer columns, keep the tables and rows
    tables, views = _names(database)
    assert "events" in tables
    assert not views & set(HISTORY_VIEWS)
    with database.session() as s:
        assert s.scalar(select(Run.name).where(Run.id == "rkeep")) == "keep"
    with pytest.raises(SchemaOutOfDate, match="slurmft db upgrade"):
        database.require_current()

    database.upgrade()
    assert database.current_revision() == head
    with database.session() as s:
        rows = read_view(s, "failures_by_node")
    assert [(r["node"], r["failures"]) for r in rows] == [("n3", 1)]

    database.downgrade("base")
    tables, views = _names(database)
    assert not (tables - {"alembic_version"}) and not views
    database.upgrade()
    _seed(database)  # the schema is whole again and takes data
    database.require_current()


def test_empty_store_says_to_upgrade(store_url: str) -> None:
    database = Database(store_url)
    with pytest.raises(SchemaOutOfDate, match=r"no slurmft schema yet: run `slurmft db upgrade`"):
        database.require_current()
    database.dispose()


def test_store_from_a_newer_slurmft_is_refused(database: Database) -> None:
    with database.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(SchemaOutOfDate, match="newer slurmft"):
        database.require_current()


def test_0006_retires_denylisted_names_that_are_no_node_names_and_keeps_them(
    database: Database,
) -> None:
    """Issue 14, item 5: entries written before names were checked end (removed_at set, the
    reason kept with why); valid and already-ended entries stay as they were; downgrading
    brings them back."""
    database.downgrade("0005")
    ended = datetime(2026, 11, 1, tzinfo=UTC)
    with database.session() as s:
        for node, removed_at in (
            ("n7", None),
            ("gpu-a.rack_2", None),
            ("n[1-6]", None),
            ("n1,n2", None),
            ("n3 --exclude", None),
            ("n4\n", None),
            ("-n5", None),
            ("n[8]", ended),  # ended already: left alone
        ):
            s.add(DenylistEntry(node=node, reason="slurmft: Xid 79", removed_at=removed_at))
    database.upgrade()
    with database.session() as s:
        rows = {e.node: (e.removed_at, e.reason) for e in s.scalars(select(DenylistEntry))}
        assert denied_nodes(s) == {"n7", "gpu-a.rack_2"}
    assert len(rows) == 8  # nothing deleted
    for node in ("n[1-6]", "n1,n2", "n3 --exclude", "n4\n", "-n5"):
        removed_at, reason = rows[node]
        assert removed_at is not None, node
        assert reason == "slurmft: Xid 79 [retired by migration 0006: not a valid Slurm node name]"
    assert rows["n7"] == (None, "slurmft: Xid 79")
    assert rows["n[8]"] == (ended, "slurmft: Xid 79")

    database.downgrade("0005")
    with database.session() as s:
        active = s.scalars(select(DenylistEntry).where(DenylistEntry.removed_at.is_(None)))
        assert {e.reason for e in active} == {"slurmft: Xid 79"}
        assert s.scalar(select(func.count()).where(DenylistEntry.removed_at.is_(None))) == 7
