"""When each training step was seen: the recovery benchmarks' clock."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class StepClock:
    """Timestamps each line rank 0 of the example appends to losses.jsonl (polled every 10 ms,
    so a time is at most 10 ms late)."""

    def __init__(self, path: Path):
        self.path = path
        self.seen: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while not self._stop.wait(0.01):
            if not self.path.exists():
                continue
            with self.path.open() as stream:
                stream.seek(offset)
                chunk = stream.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            now = time.time()
            self.seen += [(now, json.loads(line)) for line in complete.splitlines() if line]

    def first_step_after(self, since: float, world_size: int) -> tuple[float, dict] | None:
        """The first step at ``world_size`` seen after ``since`` (time.time()), and its record."""
        for seen_at, record in list(self.seen):
            if seen_at > since and record["world_size"] == world_size:
                return seen_at, record
        return None

    def last_step_before(self, until: float) -> int:
        return max((r["step"] for seen_at, r in list(self.seen) if seen_at <= until), default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
