"""`slurmft plan`: how many spares and how often to checkpoint, with the ETTR to expect.

Young/Daly give the first guess for the interval from the job's mean time between failures and
the checkpoint's cost; the simulator (running the real policy) refines it: spare counts around the
expected hardware failures of the horizon at that interval, then intervals around it at the best
spare count. Spares are not free (they hold GPUs that do not train), so the spare count is chosen
by goodput, ETTR x nodes / (nodes + spares); the interval by ETTR.

Rates come from the default table (Llama 3's) or from a store's own history: its failures by class
over the node-hours its allocations held. Below a minimum of either the planner refuses: a rate
from a handful of failures is a guess, and a plan built on it would look precise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmft.errors import SlurmftError
from slurmft.sim.inputs import HOUR, FailureRates, Hit, Inputs, Strategy, daly_interval_s
from slurmft.sim.report import Row, over_seeds

MIN_FAILURES = 20
MIN_NODE_HOURS = 5000.0
Z95 = 1.959963984540054

# What each kind of recorded failure does in the simulator (the store's event kinds).
STORE_KINDS: Mapping[str, Hit] = {
    "gpu_fault": Hit.GPU,
    "preflight_failed": Hit.GPU,
    "node_lost": Hit.NODE,
    "batch_host_down": Hit.NODE,
    "hang": Hit.HANG,
}


class TooLittleHistory(SlurmftError):
    """The store's history is too short to estimate failure rates from."""


@dataclass(frozen=True)
class StoreHistory:
    """What the store says, counted: failures by kind (node-level evidence of the runs' own
    nodes), restarts charged to the user's code, stragglers, and the node-hours held."""

    failures_by_kind: Mapping[str, int]
    user_code_restarts: int
    stragglers: int
    node_hours: float


def poisson_interval(count: int, exposure: float) -> tuple[float, float]:
    """95 % interval of a Poisson rate (Byar's approximation of the exact interval)."""
    if exposure <= 0:
        return (0.0, math.inf)
    low = 0.0
    if count > 0:
        low = count * (1 - 1 / (9 * count) - Z95 / (3 * math.sqrt(count))) ** 3
    k = count + 1
    high = k * (1 - 1 / (9 * k) + Z95 / (3 * math.sqrt(k))) ** 3
    return (low / exposure, high / exposure)


def rates_from_store(
    history: StoreHistory,
    *,
    min_failures: int = MIN_FAILURES,
    min_node_hours: float = MIN_NODE_HOURS,
) -> tuple[FailureRates, float]:
    """Per-node-hour rates by class from the store's history, and the straggler rate per node
    and day; refused below the minimums."""
    counted = {
        kind: n for kind, n in history.failures_by_kind.items() if kind in STORE_KINDS and n > 0
    }
    total = sum(counted.values()) + history.user_code_restarts
    if total < min_failures or history.node_hours < min_node_hours:
        raise TooLittleHistory(
            f"the store holds {total} failures over {history.node_hours:,.0f} node-hours; "
            f"planning needs at least {min_failures} failures and {min_node_hours:,.0f} "
            f"node-hours (--min-failures, --min-node-hours), or plan from the default table "
            f"(drop --store)"
        )
    per_node_hour = {kind: n / history.node_hours for kind, n in counted.items()}
    hits = {kind: STORE_KINDS[kind] for kind in counted}
    if history.user_code_restarts:
        per_node_hour["user_code"] = history.user_code_restarts / history.node_hours
        hits["user_code"] = Hit.SOFTWARE
    rates = FailureRates(
        per_node_hour=per_node_hour,
        hits=hits,
        source=f"store: {total} failures over {history.node_hours:,.0f} node-hours",
        sample_failures=total,
        sample_node_hours=history.node_hours,
    )
    return rates, history.stragglers / history.node_hours * 24


@dataclass(frozen=True)
class Choice:
    spares: int
    interval_s: float
    row: Row

    def as_dict(self) -> dict[str, Any]:
        return {"spares": self.spares, "interval_s": self.interval_s, **self.row.as_dict()}


@dataclass(frozen=True)
class Plan:
    inputs: Inputs
    mtbf_s: float
    young_s: float
    daly_s: float
    rate_interval: tuple[float, float]  # 95 % interval of the failures per node-hour
    spare_choices: list[Choice] = field(default_factory=list)
    interval_choices: list[Choice] = field(default_factory=list)

    @property
    def spares(self) -> Choice:
        return max(self.spare_choices, key=_by_goodput)

    @property
    def interval(self) -> Choice:
        return max(self.interval_choices, key=lambda c: c.row.ettr.mean)

    def as_dict(self) -> dict[str, Any]:
        rates = self.inputs.rates
        low, high = self.rate_interval
        return {
            "nodes": self.inputs.nodes,
            "gpus": self.inputs.gpus,
            "horizon_s": self.inputs.horizon_s,
            "checkpoint_cost_s": self.inputs.checkpoint_cost_s,
            "rates": {
                "source": rates.source,
                "sample_failures": rates.sample_failures,
                "sample_node_hours": rates.sample_node_hours,
                "per_node_hour": rates.total(),
                "per_node_hour_ci95": [low, high],
                "by_class": dict(sorted(rates.per_node_hour.items())),
            },
            "mtbf_s": self.mtbf_s,
            "mtbf_s_ci95": [_mtbf(high, self.inputs.nodes), _mtbf(low, self.inputs.nodes)],
            "young_interval_s": self.young_s,
            "daly_interval_s": self.daly_s,
            "recommended": {
                "spares": self.spares.spares,
                "checkpoint_interval_s": self.interval.interval_s,
                "ettr": self.interval.row.ettr.as_dict(),
                "goodput": self.interval.row.goodput.as_dict(),
            },
            "spare_choices": [c.as_dict() for c in self.spare_choices],
            "interval_choices": [c.as_dict() for c in self.interval_choices],
        }


def _by_goodput(choice: Choice) -> tuple[float, int]:
    """The spare count to recommend: the best goodput, the fewer spares on a tie."""
    return (choice.row.goodput.mean, -choice.spares)


def _mtbf(rate: float, nodes: int) -> float:
    return math.inf if rate <= 0 else HOUR / (rate * nodes)


def spare_candidates(inputs: Inputs) -> list[int]:
    """0 and fractions of the hardware failures expected to hit the training nodes over the
    horizon (each takes one spare), at most a tenth of the nodes."""
    rates = inputs.rates
    hardware = sum(rates.rate(h) for h in (Hit.GPU, Hit.NODE, Hit.SWITCH))
    expected = hardware * inputs.nodes * inputs.horizon_s / HOUR
    cap = max(1, inputs.nodes // 10)
    picks = {0, *(min(cap, max(1, math.ceil(expected * f))) for f in (0.125, 0.25, 0.5, 1.0))}
    return sorted(picks)


def make_plan(
    base: Inputs,
    *,
    seeds: int = 5,
    workers: int = 1,
    interval_factors: Sequence[float] = (0.5, 0.7, 1.0, 1.4, 2.0),
) -> Plan:
    """Spares by goodput at Daly's interval, then the interval by ETTR at those spares."""
    base = base.with_(strategy=Strategy.LADDER, checkpoint_interval_s=None)
    mtbf = base.rates.mtbf_s(base.nodes)
    cost = base.checkpoint_cost_s
    daly = daly_interval_s(cost, mtbf)
    young = math.sqrt(2 * cost * mtbf) if math.isfinite(mtbf) else math.inf
    spares = spare_candidates(base)
    spare_rows = over_seeds(
        [base.with_(spares=s, checkpoint_interval_s=daly) for s in spares], seeds, workers
    )
    spare_choices = [Choice(s, daly, r) for s, r in zip(spares, spare_rows, strict=True)]
    best = max(spare_choices, key=_by_goodput).spares
    intervals = [max(1.0, daly * f) for f in interval_factors]
    interval_rows = over_seeds(
        [base.with_(spares=best, checkpoint_interval_s=i) for i in intervals], seeds, workers
    )
    rates = base.rates
    return Plan(
        inputs=base.with_(spares=best),
        mtbf_s=mtbf,
        young_s=young,
        daly_s=daly,
        rate_interval=poisson_interval(rates.sample_failures, rates.sample_node_hours),
        spare_choices=spare_choices,
        interval_choices=[
            Choice(best, i, r) for i, r in zip(intervals, interval_rows, strict=True)
        ],
    )
