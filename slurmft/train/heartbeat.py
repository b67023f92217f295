"""Phase heartbeats: each phase (init, step, checkpoint, eval) has its own deadline.

A background thread sends a heartbeat every `interval_s` with the current phase, the time spent
without progress in it and that phase's deadline. A 10-minute save is then "checkpoint, 9 minutes
in, deadline 30 minutes", not ten minutes of silence that looks like a hang. The agent reads:
- heartbeats arriving and `progress_age_s <= deadline_s`: healthy;
- heartbeats arriving and `progress_age_s > deadline_s`: stuck in that phase (a hang the Python
  thread can still see, e.g. a collective that never returns);
- no heartbeat for a few intervals: the process is frozen or gone.
When one rank hangs, its peers soon hang too, inside the next collective. `section` tells them
apart: "wait" (inside a collective: a victim), "compute", or null (outside the timed sections); an
overdue rank that is not in "wait" is the suspect.

Torch-free, so the agent can import `Phase` and `is_overdue`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

from slurmft.train.report import ReportChannel


class Phase(StrEnum):
    """What a rank is doing; the agent applies the matching deadline."""

    INIT = "init"
    STEP = "step"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"
    DONE = "done"  # the last heartbeat: the rank stopped reporting on purpose (training ended)


# Seconds without progress before a phase counts as stuck. A step deadline is per step (progress =
# a completed step); init covers rendezvous, model build and checkpoint load.
DEFAULT_DEADLINES_S: dict[Phase, float] = {
    Phase.INIT: 900.0,
    Phase.STEP: 300.0,
    Phase.CHECKPOINT: 1800.0,
    Phase.EVAL: 1800.0,
    Phase.DONE: 365 * 86400.0,  # never overdue; its silence afterwards is no hang either
}


def is_overdue(message: Mapping[str, Any]) -> bool:
    """The agent's test on one heartbeat message."""
    return float(message["progress_age_s"]) > float(message["deadline_s"])


class Heartbeat:
    """Tracks the current phase and sends heartbeats from a daemon thread.

    The training loop calls `progress(step)` after each step and wraps other phases in
    `with heartbeat.phase(Phase.CHECKPOINT):`. Both only update fields; the thread does the sends.
    """

    def __init__(
        self,
        channel: ReportChannel,
        interval_s: float = 5.0,
        deadlines_s: Mapping[Phase, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.channel = channel
        self.interval_s = interval_s
        self.deadlines_s = {**DEFAULT_DEADLINES_S, **(deadlines_s or {})}
        self._clock = clock
        self._lock = threading.Lock()
        self._phase = Phase.INIT
        self._step = 0
        self._progress_at = clock()
        self._section: str | None = None
        self._stop = threading.Event()
        self._send_lock = threading.Lock()  # the thread's sends against stop()'s last one
        self._thread: threading.Thread | None = None

    @property
    def current_phase(self) -> Phase:
        return self._phase

    def message(self) -> dict[str, Any]:
        """The heartbeat fields as of now."""
        with self._lock:
            phase, step, progress_at = self._phase, self._step, self._progress_at
        age = self._clock() - progress_at
        deadline = self.deadlines_s[phase]
        return {
            "phase": phase.value,
            "section": self._section,
            "step": step,
            "progress_age_s": round(age, 3),
            "deadline_s": deadline,
            "overdue": age > deadline,
        }

    def send_now(self) -> bool:
        return self.channel.send("heartbeat", **self.message())

    def enter(self, phase: Phase, step: int | None = None) -> None:
        with self._lock:
            self._phase = phase
            if step is not None:
                self._step = step
            self._progress_at = self._clock()
        # Announce phase changes at once so a long phase never starts with a stale "step".
        self.send_now()

    def progress(self, step: int) -> None:
        """A step completed: restart the step deadline. Cheap: no system call."""
        with self._lock:
            self._step = step
            self._progress_at = self._clock()

    def set_section(self, section: str | None) -> None:
        """Set by StepTimer around compute and collective-wait sections. Cheap: one store."""
        self._section = section

    @contextmanager
    def phase(self, phase: Phase, step: int | None = None) -> Iterator[None]:
        previous = self._phase
        self.enter(phase, step)
        try:
            yield
        finally:
            self.enter(previous)

    def start(self) -> Heartbeat:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slurmft-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sending, with a last heartbeat that says so: a rank shutting down may take a
        while to exit, and its silence while slower peers still report is no hang."""
        self._stop.set()
        if self._thread is not None:
            # A send the thread has begun ends first, and none follows: under load the thread
            # could be starved past the join's timeout and send its last "init" after "done"
            # (seen in the suite), and the agent would read the rank as still reporting.
            with self._send_lock:
                self.enter(Phase.DONE)
            self._thread.join(timeout=self.interval_s + 1)
            self._thread = None
        # What the agent's full queue held back goes out before the rank ends (it reads every
        # 0.1 s); the "done" above among it.
        self.channel.flush(timeout_s=1.0)

    def _run(self) -> None:
        while True:
            with self._send_lock:
                if self._stop.is_set():
                    return
                self.send_now()
            self._stop.wait(self.interval_s)
