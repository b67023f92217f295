"""UTCDateTime's own SQLite text is the text SQLAlchemy's DATETIME writes: stored timestamps
compare as text in SQLite, so one format with another would misorder rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.sqlite import DATETIME

from slurmft.db.models import UTCDateTime

MOMENTS = [
    datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC),  # no microseconds: still written
    datetime(2026, 11, 29, 12, 0, 0, 1, tzinfo=UTC),
    datetime(1999, 1, 2, 3, 4, 5, 999_999, tzinfo=UTC),
    datetime(2026, 3, 1, 0, 30, tzinfo=timezone(timedelta(hours=5, minutes=30))),  # converted
]


@pytest.mark.parametrize("moment", MOMENTS)
def test_sqlite_text_is_sqlalchemys(moment: datetime) -> None:
    dialect = sqlite.dialect()
    ours = UTCDateTime().bind_processor(dialect)
    theirs = DATETIME().bind_processor(dialect)
    assert ours is not None and theirs is not None
    assert ours(moment) == theirs(moment.astimezone(UTC).replace(tzinfo=None))
    assert ours(None) is None


def test_a_naive_datetime_is_refused() -> None:
    process = UTCDateTime().bind_processor(sqlite.dialect())
    assert process is not None
    with pytest.raises(ValueError, match="naive datetime"):
        process(datetime(2026, 11, 29, 12))
