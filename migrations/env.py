"""Alembic environment for the slurmft store (shipped inside the wheel as slurmft.migrations)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from slurmft.db.models import Base

config = context.config
if config.config_file_name is not None and config.get_section("loggers"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: Alembic rebuilds the table in a batch instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from slurmft.config import load_config
    from slurmft.db.database import normalize_url

    return normalize_url(load_config().database_url).render_as_string(hide_password=False)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # handed over by slurmft.db.Database
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    from slurmft.db.database import Database

    database = Database(_url())
    with database.engine.begin() as conn:
        _configure(conn)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
