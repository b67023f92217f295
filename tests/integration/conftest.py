"""Stores for tests: every store test runs on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text

from slurmft.controller.http import IngestServer
from slurmft.db import Database
from slurmft.db.models import Attempt, Run
from slurmft.db.states import RunState


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty store: a fresh SQLite file, or a fresh database on the test PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'slurmft.db'}"
        return
    server = make_url(os.environ["SLURMFT_TEST_POSTGRES_URL"]).set(drivername="postgresql+psycopg")
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def database(store_url: str) -> Iterator[Database]:
    """A store at head."""
    db = Database(store_url)
    db.upgrade()
    try:
        yield db
    finally:
        db.dispose()


@pytest.fixture
def ingest_server(database: Database) -> Iterator[IngestServer]:
    """The daemon's real agent endpoint (HTTP on loopback) over the store."""
    srv = IngestServer(database).start()
    try:
        yield srv
    finally:
        srv.stop()


class RunSeeder:
    """Puts a run (and its first attempt, when it has a job) into a store, as submit would."""

    def __call__(
        self,
        database: Database,
        run_id: str,
        *,
        job_id: str | None = None,
        owner_uid: int = 0,
        owner_name: str = "root",
        nodes: int = 3,
        spares: int = 1,
        running: bool = True,
        **fields: object,
    ) -> None:
        with database.session() as session:
            run = Run(
                id=run_id,
                name=fields.pop("name", run_id),
                owner_uid=owner_uid,
                owner_name=owner_name,
                nodes=nodes,
                spares=spares,
                command=["train.py"],
                **fields,
            )
            session.add(run)
            session.flush()
            if running:
                run.state = RunState.RUNNING
            if job_id is not None:
                session.add(Attempt(run_id=run_id, number=1, slurm_job_id=job_id))


@pytest.fixture
def seed_run() -> RunSeeder:
    return RunSeeder()
