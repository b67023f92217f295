"""How `slurmft runs`, `events` and `logs` print what the daemon sends, and read their options."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import typer

from slurmft.api import RunSummary, TimelineEntry
from slurmft.cli.logs_cmd import attempt_lines, complete_lines, of_rank
from slurmft.cli.runs_cmd import entry_line, run_line, since_time

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("90m", "2026-12-01T10:30:00+00:00"),
        ("3d", "2026-11-28T12:00:00+00:00"),
        ("2026-12-01", "2026-12-01T00:00:00+00:00"),  # UTC unless it says
        ("2026-12-01T09:00+01:00", "2026-12-01T09:00:00+01:00"),
    ],
)
def test_since_is_an_age_or_a_time(given: str, expected: str) -> None:
    assert since_time(given, NOW) == expected


def test_since_that_is_neither_is_a_clear_error() -> None:
    with pytest.raises(typer.BadParameter, match=r"an ISO 8601 time .* or an age"):
        since_time("last tuesday", NOW)


def test_a_report_of_many_nodes_is_one_line_with_its_count() -> None:
    entry = {"at": "2026-12-01T12:00:00+00:00", "source": "event", "kind": "restart",
             "text": "workers restarted (round 1 -> 2)", "status": None, "count": 6,
             "nodes": ["n1", "n2", "n3", "n4", "n5", "n6"], "ranks": []}  # fmt: skip
    assert entry_line(TimelineEntry.from_dict(entry)) == (
        "2026-12-01T12:00:00+00:00  event  restart x6 n1,n2,n3,n4,+2: "
        "workers restarted (round 1 -> 2)"
    )
    action = {**entry, "source": "action", "kind": "drain_node", "status": "done", "count": 1,
              "nodes": ["n2"], "text": "Xid 79 on n2"}  # fmt: skip
    line = entry_line(TimelineEntry.from_dict(action))
    assert line.endswith("action drain_node [done] n2: Xid 79 on n2")


def test_a_run_line_shows_unknown_figures_as_dashes() -> None:
    run = {"run_id": "r1", "state": "running", "nodes": 2, "spares": 1, "job_id": "7",
           "step": None, "world_size": None, "restarts": 1, "restart_cap": 5,
           "effective_ratio": None, "name": "plain"}  # fmt: skip
    line = run_line(RunSummary.from_dict(run))
    assert "step -" in line and "world -" in line and "restarts 1/5" in line
    assert line.endswith("effective -  plain")


def test_a_requeued_jobs_output_is_cut_at_each_attempts_batch_step() -> None:
    lines = [
        "slurmft-store ready 5000\n",
        "2026-12-01 08:00:00,000 slurmft agent[batch] INFO batch step of job 7, Slurm restart 0, "
        "on n1\n",
        "first attempt\n",
        "2026-12-01 08:05:00,000 slurmft agent[batch] INFO batch step of job 7, Slurm restart 1, "
        "on n2\n",
        "second attempt\n",
    ]
    assert attempt_lines(lines, "7", 0) == lines[:3]  # the store's line is the first attempt's
    assert attempt_lines(lines, "7", 1) == lines[3:]
    assert attempt_lines(lines, "7", 2) == []  # not started yet
    assert attempt_lines(["no marks\n"], "7", 1) == ["no marks\n"]  # older output: whole


def test_a_ranks_lines_without_their_label_and_nobody_elses() -> None:
    lines = [
        "2026-12-01 12:00:00,001 slurmft agent[n1] INFO starting torchrun\n",
        "[rank0]: rank 0 of 12 training from step 0\n",
        "[rank10]: rank 10 of 12 training from step 0\n",
        "[rank1]: Traceback (most recent call last):\n",
        "[rank1]: [rank0]: a label inside a line is the line's\n",
        "rank1: not a label\n",
    ]
    assert of_rank(lines, 1) == [
        "Traceback (most recent call last):\n",
        "[rank0]: a label inside a line is the line's\n",
    ]
    assert of_rank(lines, 0) == ["rank 0 of 12 training from step 0\n"]
    assert of_rank(lines, 2) == []
    assert of_rank(lines, None) == lines


def test_followed_output_comes_in_whole_lines() -> None:
    chunks = iter(["[rank1]: ha", "lf a line\n[rank1]: two\n", "", "[rank1]: and a tail"])
    assert list(complete_lines(chunks)) == [
        "[rank1]: half a line\n", "[rank1]: two\n", "[rank1]: and a tail",
    ]  # fmt: skip
