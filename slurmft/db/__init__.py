"""The store: typed models, the Database facade, ingest and failure-history queries.

Importing a submodule (``slurmft.db.history``) does not load the others: the Database facade
(SQLAlchemy and Alembic) is loaded when it is first named.
"""

from typing import TYPE_CHECKING

from slurmft._lazy import lazy_exports

if TYPE_CHECKING:
    from slurmft.db.database import (
        Database,
        DatabaseError,
        DatabaseUnavailable,
        SchemaOutOfDate,
    )
    from slurmft.db.states import AttemptState, IllegalTransition, RunState

_EXPORTS = {
    "Database": "database",
    "DatabaseError": "database",
    "DatabaseUnavailable": "database",
    "SchemaOutOfDate": "database",
    "AttemptState": "states",
    "IllegalTransition": "states",
    "RunState": "states",
}

__all__ = [
    "AttemptState",
    "Database",
    "DatabaseError",
    "DatabaseUnavailable",
    "IllegalTransition",
    "RunState",
    "SchemaOutOfDate",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
