"""The one facade that owns engines, sessions and schema upgrades. Nothing else builds engines."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from slurmft.config import Config, DatabaseSection, check_sqlite_location
from slurmft.errors import SlurmftError

log = logging.getLogger(__name__)

UPGRADE_HINT = "slurmft db upgrade"


class DatabaseError(SlurmftError, RuntimeError):
    """The store cannot be used; the message says why and what to do."""


class DatabaseUnavailable(DatabaseError):
    """The database server or file cannot be reached."""


class DatabaseBusy(DatabaseUnavailable):
    """SQLite's writer lock was held by another writer past the busy timeout: retry soon."""


class SchemaOutOfDate(DatabaseError):
    """The schema is not at the revision this slurmft needs."""


def migrations_dir() -> Path:
    """The Alembic environment: inside the installed wheel, or at the top of a source tree."""
    package_dir = Path(__file__).resolve().parents[1]  # slurmft/
    for candidate in (package_dir / "migrations", package_dir.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise DatabaseError(
        f"the migrations are missing (looked in {package_dir / 'migrations'} and "
        f"{package_dir.parent / 'migrations'}): reinstall slurmft"
    )


def normalize_url(url: str) -> URL:
    """Parse a store URL; plain ``postgresql://`` is driven by psycopg 3."""
    try:
        parsed = make_url(url)
    except Exception as exc:  # SQLAlchemy raises ArgumentError with a terse message
        raise DatabaseError(
            f"database.url {url!r} is not a valid URL ({exc}); use e.g. "
            f"sqlite:////var/lib/slurmft/slurmft.db or postgresql://user@host/dbname"
        ) from None
    if parsed.drivername in {"postgresql", "postgres"}:
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in {"sqlite", "postgresql"}:
        raise DatabaseError(
            f"database.url uses {parsed.get_backend_name()!r}; slurmft supports sqlite and "
            f"postgresql"
        )
    return parsed


@dataclass(frozen=True)
class SchemaStatus:
    current: str | None
    head: str

    @property
    def at_head(self) -> bool:
        return self.current == self.head


def _sqlite_pragmas(busy_timeout_ms: int) -> Any:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # WAL lets the CLI read while the daemon writes; NORMAL is durable under WAL except for
        # the last transactions on power loss, which the agents' at-least-once resend covers.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.close()

    return on_connect


class Database:
    """Engine, sessions and migrations for one store URL."""

    def __init__(
        self,
        url: str,
        *,
        busy_timeout_ms: int = DatabaseSection.busy_timeout_ms,
        pool_size: int = DatabaseSection.pool_size,
    ) -> None:
        self.url = normalize_url(url)
        self.engine = self._create_engine(busy_timeout_ms, pool_size)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def from_config(cls, config: Config) -> Database:
        return cls(
            config.database_url,
            busy_timeout_ms=config.settings.database.busy_timeout_ms,
            pool_size=config.settings.database.pool_size,
        )

    @property
    def dialect(self) -> str:
        return self.url.get_backend_name()

    def describe(self) -> str:
        """The URL without its password, for messages."""
        return self.url.render_as_string(hide_password=True)

    def _create_engine(self, busy_timeout_ms: int, pool_size: int) -> Engine:
        if self.dialect == "sqlite":
            path = self.url.database
            if path and path != ":memory:" and not path.startswith("file:"):
                db_path = Path(path).expanduser()
                try:
                    db_path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise DatabaseUnavailable(
                        f"cannot create the directory of the SQLite store {db_path}: "
                        f"{exc.strerror}. Set paths.state_dir or database.url to a writable place."
                    ) from exc
                check_sqlite_location(db_path)
            engine = create_engine(self.url)
            event.listen(engine, "connect", _sqlite_pragmas(busy_timeout_ms))
            return engine
        return create_engine(
            self.url,
            pool_size=pool_size,
            pool_pre_ping=True,
            connect_args={"connect_timeout": 10},
        )

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: committed when the block ends, rolled back if it raises."""
        with self._translate_errors(), self._sessions.begin() as session:
            yield session

    @contextmanager
    def _translate_errors(self) -> Iterator[None]:
        try:
            yield
        except OperationalError as exc:
            if _is_unreachable(exc):
                raise DatabaseUnavailable(
                    f"cannot reach the store at {self.describe()}: {_first_line(exc)}. "
                    f"Check database.url (`slurmft config show`) and that the server is running."
                ) from exc
            if "database is locked" in str(exc.orig).lower():
                raise DatabaseBusy(
                    f"the store at {self.describe()} is busy: another writer held it past "
                    f"database.busy_timeout_ms; retry"
                ) from exc
            raise

    # --- schema ---------------------------------------------------------------------------

    def _alembic_config(self) -> AlembicConfig:
        cfg = AlembicConfig()
        cfg.set_main_option("script_location", str(migrations_dir()))
        cfg.set_main_option(
            "sqlalchemy.url", self.url.render_as_string(hide_password=False).replace("%", "%%")
        )
        return cfg

    def head_revision(self) -> str:
        heads = ScriptDirectory.from_config(self._alembic_config()).get_heads()
        if len(heads) != 1:
            raise DatabaseError(f"the migrations have {len(heads)} heads: {heads}")
        return heads[0]

    def current_revision(self) -> str | None:
        with self._translate_errors(), self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def schema_status(self) -> SchemaStatus:
        return SchemaStatus(current=self.current_revision(), head=self.head_revision())

    def require_current(self) -> None:
        """Refuse to go on with a schema that is not at head, naming the command that fixes it."""
        status = self.schema_status()
        if status.at_head:
            return
        if status.current is None:
            raise SchemaOutOfDate(
                f"the store at {self.describe()} has no slurmft schema yet: run `{UPGRADE_HINT}`"
            )
        if not self._knows_revision(status.current):
            raise SchemaOutOfDate(
                f"the store at {self.describe()} is at revision {status.current}, which this "
                f"slurmft does not know (a newer slurmft migrated it): upgrade slurmft"
            )
        raise SchemaOutOfDate(
            f"the store at {self.describe()} is at revision {status.current}, behind "
            f"{status.head}: run `{UPGRADE_HINT}`"
        )

    def _knows_revision(self, revision: str) -> bool:
        script = ScriptDirectory.from_config(self._alembic_config())
        try:
            return script.get_revision(revision) is not None
        except CommandError:
            return False

    def upgrade(self, revision: str = "head") -> None:
        self._run_alembic(command.upgrade, revision)

    def downgrade(self, revision: str) -> None:
        self._run_alembic(command.downgrade, revision)

    def _run_alembic(self, fn: Any, revision: str) -> None:
        cfg = self._alembic_config()
        try:
            with self._translate_errors(), self.engine.begin() as conn:
                cfg.attributes["connection"] = conn
                fn(cfg, revision)
        except CommandError as exc:
            raise DatabaseError(f"migration to {revision!r} failed: {exc}") from exc

    def dispose(self) -> None:
        self.engine.dispose()


def _is_unreachable(exc: OperationalError) -> bool:
    text = str(exc.orig).lower()
    markers = (
        "connection",
        "could not connect",
        "unable to open database",
        "server closed",
        "timeout expired",
        "no such host",
        "name or service not known",
        "refused",
    )
    return any(marker in text for marker in markers)


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__


__all__ = [
    "Database",
    "DatabaseBusy",
    "DatabaseError",
    "DatabaseUnavailable",
    "SchemaOutOfDate",
    "SchemaStatus",
    "migrations_dir",
    "normalize_url",
]
