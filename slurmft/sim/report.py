"""Many seeds of many settings, side by side: the strategies table with 95 % confidence
intervals, and the sensitivity of the ladder's ETTR to checkpoint cost and recovery time."""

from __future__ import annotations

import math
import multiprocessing
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from slurmft.sim.engine import simulate
from slurmft.sim.inputs import Inputs, Strategy

# Student's t, two-sided 95 %, by degrees of freedom (past 30, the normal's 1.96 is within 2 %).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip

LOSSES = ("detection", "restart", "queue", "replay", "checkpoint", "stopped")


@dataclass(frozen=True)
class Estimate:
    mean: float
    half_width: float  # of the 95 % confidence interval over seeds
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Estimate:
        n = len(values)
        mean = statistics.fmean(values) if values else math.nan
        if n < 2:
            return cls(mean, math.inf, n)
        t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
        return cls(mean, t * statistics.stdev(values) / math.sqrt(n), n)

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "ci95": self.half_width, "n": self.n}


def run_all(settings: Iterable[Inputs], workers: int = 1) -> list[dict[str, Any]]:
    """Each setting simulated (one seed each), summaries in the same order; ``workers``
    processes side by side (the simulator is pure Python: one core each)."""
    todo = list(settings)
    if workers <= 1 or len(todo) <= 1:
        return [_summary(s) for s in todo]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_summary, todo, chunksize=1)


def _summary(inputs: Inputs) -> dict[str, Any]:
    return simulate(inputs).summary()


@dataclass(frozen=True)
class Row:
    """One setting over its seeds."""

    strategy: str
    spares: int
    nodes: int
    checkpoint_cost_s: float
    recovery_scale: float
    ettr: Estimate
    # ETTR x nodes / (nodes + spares): the share of the allocated GPU time that trained.
    goodput: Estimate
    lost_h: dict[str, Estimate]  # mean hours lost per week... per horizon, by cause
    counts: dict[str, Estimate]

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "spares": self.spares,
            "nodes": self.nodes,
            "checkpoint_cost_s": self.checkpoint_cost_s,
            "recovery_scale": self.recovery_scale,
            "ettr": self.ettr.as_dict(),
            "goodput": self.goodput.as_dict(),
            "lost_h": {k: v.as_dict() for k, v in self.lost_h.items()},
            "counts": {k: v.as_dict() for k, v in self.counts.items()},
        }


def summarize(summaries: Sequence[dict[str, Any]], recovery_scale: float = 1.0) -> Row:
    first = summaries[0]
    nodes, spares = first["nodes"], first["spares"]
    ettr = [s["ettr"] for s in summaries]
    lost = {k: Estimate.of([s["lost_s"].get(k, 0.0) / 3600 for s in summaries]) for k in LOSSES}
    counts = {
        k: Estimate.of([float(s[k]) for s in summaries])
        for k in ("spares_used", "drains", "requeues", "stops")
    }
    counts["interruptions"] = Estimate.of(
        [float(sum(s["interruptions"].values())) for s in summaries]
    )
    return Row(
        strategy=first["strategy"],
        spares=spares,
        nodes=nodes,
        checkpoint_cost_s=first["checkpoint_cost_s"],
        recovery_scale=recovery_scale,
        ettr=Estimate.of(ettr),
        goodput=Estimate.of([e * nodes / (nodes + spares) for e in ettr]),
        lost_h=lost,
        counts=counts,
    )


def strategies_table(
    base: Inputs,
    strategies: Sequence[Strategy],
    spares: Sequence[int],
    seeds: int,
    workers: int = 1,
) -> list[Row]:
    """Every strategy at every spare count, each over ``seeds`` seeds (the same seeds for all,
    so that the partition and its lemons are the same across a row)."""
    cells = [base.with_(strategy=st, spares=sp) for st in strategies for sp in spares]
    return over_seeds(cells, seeds, workers)


def sensitivity_table(
    base: Inputs,
    costs_s: Sequence[float],
    recovery_scales: Sequence[float],
    seeds: int,
    workers: int = 1,
) -> list[Row]:
    """The base setting (strategy and spares as given) at each checkpoint cost (the interval
    Young/Daly's for it, unless fixed) and each multiple of every recovery time."""
    cells = [(c, r) for c in costs_s for r in recovery_scales]
    settings = [scaled(base.with_(checkpoint_cost_s=c), r) for c, r in cells]
    return over_seeds(settings, seeds, workers, [r for _, r in cells])


def over_seeds(
    settings: Sequence[Inputs],
    seeds: int,
    workers: int = 1,
    recovery_scales: Sequence[float] | None = None,
) -> list[Row]:
    """One row per setting, each over ``seeds`` seeds (its own and the next ones: the same
    seeds for every setting, so the partition and its lemons are the same across rows)."""
    runs = [s.with_(seed=s.seed + k) for s in settings for k in range(seeds)]
    out = run_all(runs, workers)
    scales = recovery_scales or [1.0] * len(settings)
    return [summarize(out[i * seeds : (i + 1) * seeds], scales[i]) for i in range(len(settings))]


def scaled(inputs: Inputs, factor: float) -> Inputs:
    """Every recovery path ``factor`` times as long (restart, spare swap, requeue start-up)."""
    return inputs.with_(
        restart_in_place_s=inputs.restart_in_place_s * factor,
        spare_swap_s=inputs.spare_swap_s * factor,
        job_startup_s=inputs.job_startup_s * factor,
    )


def _pct(e: Estimate) -> str:
    return f"{100 * e.mean:6.2f} ± {100 * e.half_width:4.2f}"


def format_rows(rows: Sequence[Row], *, sensitivity: bool = False) -> str:
    """A plain-text table; hours lost are means per run over the horizon."""
    first = ("ckpt_s", "recov") if sensitivity else ("strategy", "spares")
    head = [*first, "ETTR %", "goodput %", *(f"{k[:6]}_h" for k in LOSSES),
            "spares", "drains", "requeue", "stops"]  # fmt: skip
    lines = ["  ".join(f"{h:>16}" if "%" in h else f"{h:>8}" for h in head)]
    for row in rows:
        key = (
            (f"{row.checkpoint_cost_s:g}", f"x{row.recovery_scale:g}")
            if sensitivity
            else (row.strategy, str(row.spares))
        )
        cells = [
            *(f"{k:>8}" for k in key),
            f"{_pct(row.ettr):>16}",
            f"{_pct(row.goodput):>16}",
            *(f"{row.lost_h[k].mean:8.2f}" for k in LOSSES),
            *(f"{row.counts[k].mean:8.1f}" for k in ("spares_used", "drains", "requeues", "stops")),
        ]
        lines.append("  ".join(cells))
    return "\n".join(lines)
