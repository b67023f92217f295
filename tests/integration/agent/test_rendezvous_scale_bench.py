"""The rendezvous-at-scale benchmark still runs: its small version (32 members, 2 processes,
one leave, both polls). The figure itself (32 to 128 members) comes from running
scripts/bench/rendezvous_scale.py by hand (docs/agent.md, "The rendezvous at scale"); no timing
goal is asserted here beyond sanity bounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch]

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench" / "rendezvous_scale.py"
KEEP_ALIVE_S = 4  # 1 s x 4: the dead member's heartbeat expires within this of the leave


def test_the_small_rendezvous_benchmark_completes_rounds_after_a_leave() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--timeout-s", "60"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rendezvous_scale ")]
    results = [dict(field.split("=", 1) for field in line.split()[1:]) for line in lines]
    assert [r["poll"] for r in results] == ["slurmft(0.1s)", "torch(1s)"], done.stdout
    for result in results:
        assert result["members"] == "32"
        assert result["round_members"] == "31"  # N:N with one spare: the spare took the place
        first = float(result["first_round_s"])
        p50, worst = float(result["rejoin_round_s_p50"]), float(result["rejoin_round_s_max"])
        after_expiry = float(result["after_expiry_s_max"])
        assert 0 < first < 60
        # The round cannot complete before the dead member's heartbeat has expired.
        assert 0 < float(result["expiry_s_mean"]) <= KEEP_ALIVE_S + 0.5
        assert 0 < p50 <= worst < 60
        assert 0 <= after_expiry < worst
        assert float(result["store_requests_per_s"]) > 0
