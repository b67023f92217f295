"""The store: typed models, the Database facade, ingest and failure-history queries."""

from slurmft.db.database import (
    Database,
    DatabaseError,
    DatabaseUnavailable,
    SchemaOutOfDate,
)
from slurmft.db.states import AttemptState, IllegalTransition, RunState

__all__ = [
    "AttemptState",
    "Database",
    "DatabaseError",
    "DatabaseUnavailable",
    "IllegalTransition",
    "RunState",
    "SchemaOutOfDate",
]
