#!/usr/bin/env python3
"""How fast the simulator is, and what it says at 16,384 GPUs.

1. One seed-week of the ladder at 2,048 nodes (16,384 GPUs) with 16 spares, timed alone, with
   the number of control passes (decide calls) and the seconds per pass.
2. The full table: --seeds seeds x 3 strategies x 4 spare counts (0, 8, 16, 32) over a week at
   2,048 nodes, on --workers processes side by side, timed; printed as `slurmft simulate` does.
3. Llama 3's setting (requeue only, no spares, a dedicated cluster, a 3 s checkpoint every
   5 minutes) over the same seeds.

Prints `simulate one_week_s=... passes=... ms_per_pass=... table_s=... runs=... workers=...`
and the tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slurmft.sim.engine import simulate
from slurmft.sim.inputs import Inputs, Strategy, meta_like_inputs
from slurmft.sim.report import format_rows, strategies_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--nodes", type=int, default=2048)
    args = parser.parse_args()

    base = Inputs(nodes=args.nodes)
    started = time.perf_counter()
    one = simulate(base.with_(strategy=Strategy.LADDER, spares=16, seed=0))
    one_s = time.perf_counter() - started
    passes = one.counts.passes

    started = time.perf_counter()
    rows = strategies_table(base, list(Strategy), (0, 8, 16, 32), args.seeds, args.workers)
    table_s = time.perf_counter() - started
    meta = strategies_table(meta_like_inputs(base), [Strategy.REQUEUE], (0,), args.seeds,
                            args.workers)  # fmt: skip
    print(
        f"simulate one_week_s={one_s:.1f} passes={passes} "
        f"ms_per_pass={1000 * one_s / max(1, passes):.1f} table_s={table_s:.0f} "
        f"runs={len(rows) * args.seeds} workers={args.workers} nodes={args.nodes}"
    )
    print(format_rows(rows))
    print("\nMeta-like (requeue only, no spares, no queue wait, 3 s checkpoint every 300 s):")
    print(format_rows(meta))


if __name__ == "__main__":
    main()
