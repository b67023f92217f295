from __future__ import annotations

import json
import logging

import pytest

from slurmft.logs import JsonFormatter, TextFormatter, setup_logging


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "slurmft.act", logging.INFO, __file__, 1, "drained %s", ("n2",), None
    )
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_json_lines_carry_run_and_node() -> None:
    entry = json.loads(JsonFormatter().format(_record(run_id="r1", node="n2")))
    assert (entry["level"], entry["logger"], entry["msg"]) == ("INFO", "slurmft.act", "drained n2")
    assert (entry["run_id"], entry["node"]) == ("r1", "n2")
    assert entry["ts"].endswith("+00:00")


def test_text_lines_without_timestamps_under_journald() -> None:
    line = TextFormatter(timestamps=False).format(_record(run_id="r1"))
    assert line == "INFO slurmft.act: drained n2 [run_id=r1]"
    assert TextFormatter(timestamps=True).format(_record()).endswith("INFO slurmft.act: drained n2")


def test_setup_picks_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    setup_logging("DEBUG", "json")
    (handler,) = logging.getLogger().handlers
    assert isinstance(handler.formatter, JsonFormatter)
    setup_logging("INFO", "text")
    (handler,) = logging.getLogger().handlers
    assert isinstance(handler.formatter, TextFormatter)
    assert logging.getLogger("apscheduler").level == logging.WARNING
