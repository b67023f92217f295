"""Logging for the daemon and the agent: plain lines for journald, or JSON lines.

Under systemd (JOURNAL_STREAM is set) journald stamps each line itself, so text lines carry no
timestamp. Records may carry ``run_id`` and ``node`` (``extra=``): both formats show them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

from slurmft.config import LogSection

_CONTEXT = ("run_id", "node")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _CONTEXT:
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, *, timestamps: bool) -> None:
        prefix = "%(asctime)s " if timestamps else ""
        super().__init__(prefix + "%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(
            f"{k}={getattr(record, k)}" for k in _CONTEXT if getattr(record, k, None) is not None
        )
        return f"{line} [{context}]" if context else line


def setup_logging(level: str = LogSection.level, fmt: str = LogSection.format) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(timestamps="JOURNAL_STREAM" not in os.environ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # APScheduler logs every job run at INFO: too chatty for a 5 s loop.
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, root.level))
