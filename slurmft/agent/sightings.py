"""What each agent saw of the run's failures, for the batch step's restart budget.

torchrun restarts crashed workers in place (its `--max-restarts` is set high), so an agent step
may go through any number of failures without ending, and with the daemon away nobody would
count them. Each agent therefore appends what it sees to a small file next to its step outcome
(`<ckpt>/.slurmft/steps/<job>.<launch>/<node>.sightings.jsonl`): its workers restarted, a local
rank saw a peer fail (a collective error), a verified checkpoint was published (with its step),
it killed hung workers. The batch step reads the step's files every few seconds, turns them
into the daemon's `Sighting`s and charges them with the daemon's own rule
(`budget_from_history`).

One JSON line per sighting, appended with one write: a node that dies mid-write leaves at most
a torn last line, which the reader skips. Agents that left the step (their outcome file says so)
are node removals, as the daemon counts them, so the restart they caused is free.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from slurmft.core.budget import (
    FAILURE_REPORTS,
    RestartBudget,
    Seen,
    Sighting,
    budget_from_history,
    restart_groups,
)
from slurmft.core.exits import StepOutcome

log = logging.getLogger(__name__)

SIGHTINGS_SUFFIX = ".sightings.jsonl"
RECORDED_KINDS = frozenset(
    {Seen.FAILURE, Seen.RESTART, Seen.CHECKPOINT, Seen.HANG, Seen.NUMERICAL}
)


def sightings_path(step_dir: str, node: str) -> Path:
    return Path(step_dir) / f"{node}{SIGHTINGS_SUFFIX}"


class SightingLog:
    """The agent's side: appends one line per sighting; does nothing without a step folder."""

    def __init__(self, step_dir: str, node: str):
        self.path = sightings_path(step_dir, node) if step_dir else None

    def record(
        self, kind: Seen, *, rank: int = -1, step: int = -1, at: float = 0.0, round: str = ""
    ) -> None:
        if self.path is None:
            return
        record = {"kind": kind.value, "at": at or time.time(), "rank": rank, "step": step}
        line = json.dumps({**record, "round": round})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{line}\n".encode())  # one write: whole line, or a torn last one
            finally:
                os.close(fd)
        except OSError as error:  # a full or gone shared disk must not take training down
            log.warning("could not record %s in %s: %s", kind.value, self.path, error)


def parse_sightings(text: str, agent: str) -> list[Sighting]:
    """One agent's file as sightings; a torn last line (no newline yet) and foreign lines are
    skipped."""
    lines = text.split("\n")[:-1]  # what follows the last newline is unfinished
    found = []
    for line in lines:
        try:
            record = json.loads(line)
            kind = Seen(record["kind"])
            at = datetime.fromtimestamp(float(record["at"]), UTC)
            rank, step = int(record.get("rank", -1)), int(record.get("step", -1))
            ended = record.get("round") or ""
        except (ValueError, KeyError, TypeError):
            continue
        if kind in RECORDED_KINDS and isinstance(ended, str):
            found.append(Sighting(kind, at, agent=agent, rank=rank, step=step, round=ended))
    return found


def departures(step_dir: str, left_before: datetime | None = None) -> list[Sighting]:
    """Agents that left the step (their node taken out of the run), when they wrote so; with
    ``left_before``, only those that left before then (after it, the batch step stopped them
    all: their leaving caused nothing)."""
    found = []
    for path in Path(step_dir).glob("*.json"):
        try:
            record = json.loads(path.read_text())
            left = StepOutcome(record["outcome"]).departed
            at = datetime.fromtimestamp(path.stat().st_mtime, UTC)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a foreign or half-replaced file says nothing
        if left and (left_before is None or at < left_before):
            found.append(Sighting(Seen.NODE_REMOVED, at))
    return found


def read_step(step_dir: str, left_before: datetime | None = None) -> list[Sighting]:
    """Everything the agents of one step recorded, and the agents that left it (before
    ``left_before``, see `departures`)."""
    if not step_dir:
        return []
    found = departures(step_dir, left_before)
    for path in sorted(Path(step_dir).glob(f"*{SIGHTINGS_SUFFIX}")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        # The agent's id for grouping: one agent per node in a step.
        found += parse_sightings(text, path.name.removesuffix(SIGHTINGS_SUFFIX))
    return found


def charge_step(before: RestartBudget, sightings: Iterable[Sighting]) -> RestartBudget:
    """The budget after an agent step's in-place restarts, on top of what was charged before
    it (earlier steps, requeues): the daemon's rule, from the daemon's kind of evidence. Spent,
    it is the budget at the failure that spent it (the batch step reads every few seconds, and
    torchrun may have restarted the workers again by then)."""
    seen = list(sightings)
    budget = budget_from_history(seen, before.max_restarts_without_progress, start=before)
    if not budget.exhausted:
        return budget
    for first_report in restart_groups(seen):
        # The failures up to this one; the evidence about their causes stays whole.
        upto = [s for s in seen if s.kind not in FAILURE_REPORTS or s.at <= first_report]
        spent = budget_from_history(upto, before.max_restarts_without_progress, start=before)
        if spent.exhausted:
            return spent
    return budget
