"""scripts/bench/ingest_load.py still runs: 64 agents for a minute against a real daemon, on
SQLite and on PostgreSQL.

The figures (2,048 agents, 10 minutes at the top) are the benchmark's, not this test's: here the
agents must all be acknowledged and stored (lost=0, every agent's cursor in the store at its last
acknowledged batch), post about once a second each, and leave rows of every kind they report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "scripts" / "bench" / "ingest_load.py"
AGENTS = 64


def run_bench(store: str, seconds: int) -> tuple[dict[str, dict[str, str]], str]:
    """The bench's key=value lines by their first word, and its whole output."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--ramp", str(AGENTS), "--top-s", str(seconds),
         "--stores", store, "--no-pin"],
        capture_output=True, text=True, timeout=seconds + 180, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines: dict[str, dict[str, str]] = {}
    for line in done.stdout.splitlines():
        name, *fields = line.split()
        if fields and all("=" in field for field in fields):
            assert name not in lines, output
            lines[name] = dict(field.split("=", 1) for field in fields)
    return lines, output


@pytest.mark.parametrize(
    ("store", "seconds"),
    [
        pytest.param("sqlite", 60, id="sqlite"),
        pytest.param("postgres", 60, id="postgres", marks=pytest.mark.postgres),
    ],
)
def test_64_agents_for_a_minute_are_all_stored(store: str, seconds: int) -> None:
    if store == "postgres":
        assert os.environ.get("SLURMFT_TEST_POSTGRES_URL"), "the postgres mark sees to it"
    lines, output = run_bench(store, seconds)
    found = lines["ingest_load"]
    assert found["store"] == store and found["agents"] == str(AGENTS), output
    assert found["lost"] == "0", output
    assert found["refused"] == "0", output
    # Once a second each (a late post carries two seconds, so a little under).
    assert 0.8 * AGENTS <= float(found["posts_per_s"]) <= 1.05 * AGENTS, output
    assert float(found["ack_p50_ms"]) > 0 and float(found["daemon_cpu_pct"]) > 0, output
    rows = {table: int(count) for table, count in lines["store_rows"].items() if table != "store"}
    # Every rank's newest heartbeat, its sampled history, and most steps of the minute (10 s).
    assert rows["rank_heartbeats"] == AGENTS * 8, output
    assert rows["rank_heartbeat_samples"] >= AGENTS * 8, output
    assert rows["step_times"] >= AGENTS * 8 * 4, output
    assert "store_size" in lines and "store_bytes_per_row" in lines, output
