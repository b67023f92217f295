"""What the simulator is given: the failure-rate table, the cluster, the costs and the strategy.

Every input is a parameter; the defaults are fixed and cited (docs/simulate.md lists the sources).
Local benchmark figures (seconds on six simulated nodes) are lower bounds, never at-scale
defaults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum

from slurmft.errors import SlurmftError


class Hit(StrEnum):
    """What a failure does to the simulated cluster (each cause maps to one)."""

    GPU = "gpu"  # a drain-class GPU fault on one node: its workers die, the agent reports the Xid
    NODE = "node"  # the node goes silent (host, NIC, PSU...): no report, Slurm loses it later
    SWITCH = "switch"  # a leaf switch: every node of one rack goes silent at once, spares too
    SOFTWARE = "software"  # the job's code crashes on one rank; the node is fine
    HANG = "hang"  # a collective that never returns: every rank stuck in its step


@dataclass(frozen=True)
class Cause:
    name: str
    count: int  # interruptions in the reference period
    hit: Hit


# The Llama 3 paper ("The Llama 3 Herd of Models", 2024, table 5): 419 unexpected interruptions
# in a 54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 nodes of 8).
LLAMA3_DAYS = 54.0
LLAMA3_NODES = 2048
LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause("faulty GPU", 148, Hit.GPU),
    Cause("GPU HBM3 memory", 72, Hit.GPU),
    Cause("software bug", 54, Hit.SOFTWARE),
    Cause("network switch/cable", 35, Hit.NODE),  # a share of them whole switches: see Inputs
    Cause("host maintenance", 32, Hit.NODE),
    Cause("GPU SRAM memory", 19, Hit.GPU),
    Cause("GPU system processor", 17, Hit.GPU),
    Cause("NIC", 7, Hit.NODE),
    Cause("NCCL watchdog timeouts", 7, Hit.HANG),
    Cause("silent data corruption", 6, Hit.GPU),  # found by a GPU check, the node drained
    Cause("GPU thermal interface and sensor", 6, Hit.GPU),
    Cause("SSD", 3, Hit.NODE),
    Cause("power supply", 3, Hit.NODE),
    Cause("server chassis", 2, Hit.NODE),
    Cause("IO expansion board", 2, Hit.NODE),
    Cause("dependency", 2, Hit.SOFTWARE),
    Cause("CPU", 2, Hit.NODE),
    Cause("system memory", 2, Hit.NODE),
)

HOUR = 3600.0
DAY = 24 * HOUR
WEEK = 7 * DAY


@dataclass(frozen=True)
class FailureRates:
    """Interruptions per node-hour, by cause. Node-level causes hit each node of the allocation
    (spares too); job-level ones (software, hangs) scale with the nodes that train."""

    per_node_hour: Mapping[str, float]
    hits: Mapping[str, Hit]
    # Where the rates come from, for the report ("default table" or "store: ...").
    source: str = "Llama 3 table 5 (419 interruptions, 54 days, 2,048 nodes)"
    sample_failures: int = 419
    sample_node_hours: float = LLAMA3_DAYS * 24 * LLAMA3_NODES

    @classmethod
    def llama3(cls) -> FailureRates:
        hours = LLAMA3_DAYS * 24 * LLAMA3_NODES
        return cls(
            per_node_hour={c.name: c.count / hours for c in LLAMA3_CAUSES},
            hits={c.name: c.hit for c in LLAMA3_CAUSES},
        )

    def rate(self, hit: Hit) -> float:
        """Failures per node-hour of one kind."""
        return sum(r for name, r in self.per_node_hour.items() if self.hits[name] is hit)

    def total(self) -> float:
        return sum(self.per_node_hour.values())

    def mtbf_s(self, nodes: int) -> float:
        """Mean time between interruptions of a job on ``nodes`` nodes, in seconds."""
        total = self.total() * nodes
        return math.inf if total <= 0 else HOUR / total


class Strategy(StrEnum):
    """How failures are recovered from."""

    # Every failure ends the job; Slurm requeues it (the site's health check drains a node
    # that failed); it resumes from the last durable checkpoint.
    REQUEUE = "requeue"
    # An in-job restarter (NVIDIA's resiliency extension, about a minute) for software faults
    # and hangs; a hardware fault needs a new node, so the job is requeued.
    IN_JOB = "in_job"
    # slurmft's ladder: in-place restart, a warm spare in the same allocation, requeue without
    # the bad nodes, crash-loop stop, all decided by the real policy (slurmft.controller.decide).
    LADDER = "ladder"


@dataclass(frozen=True)
class Inputs:
    """One simulated run. Times in seconds. Defaults: docs/simulate.md says where each is from."""

    nodes: int = 2048  # that train
    gpus_per_node: int = 8
    spares: int = 0  # warm spares in the allocation
    strategy: Strategy = Strategy.LADDER
    horizon_s: float = WEEK
    rates: FailureRates = field(default_factory=FailureRates.llama3)
    # Nodes of the partition beside the job's own (what a requeue can take instead).
    pool_nodes: int | None = None  # None: 5 % of the job's nodes, at least 2
    rack_nodes: int = 16  # nodes behind one leaf switch
    switch_share: float = 0.2  # of network switch/cable failures, whole switches
    # 3 of 63 nodes behind more than half of all exclusions (a 504-GPU production cluster):
    # lemons are ~5 % of nodes at 20x the hardware rate (together ~half of hardware failures).
    lemon_share: float = 3 / 63
    lemon_factor: float = 20.0
    repair_s: float = 2 * DAY  # a drained or dead node back in the partition
    switch_repair_s: float = 4 * HOUR  # a leaf switch replaced: its rack back
    # Stragglers: a node slower by `straggler_slowdown`, until repaired or removed.
    stragglers_per_node_day: float = 0.0005
    straggler_slowdown: float = 0.5
    straggler_s: float = 12 * HOUR
    # Software bugs that repeat on every restart until a person fixes the code (a crash loop).
    crash_loop_share: float = 0.0
    crash_loop_after_s: float = 30.0  # of training before the bug strikes again
    human_fix_s: float = 2 * HOUR
    # Failures every this many seconds exactly, on the first training node (the batch host
    # until it leaves), of this class, instead of the rate table (the closed-form check).
    failure_every_s: float | None = None
    failure_every_hit: Hit | None = Hit.SOFTWARE  # None: a straggler
    # Checkpoints: interval of training time between durable checkpoints (None: Young/Daly for
    # these rates) and the time each blocks training.
    checkpoint_interval_s: float | None = None
    checkpoint_cost_s: float = 0.78  # asynchronous, Llama 3 70B on 1,856 GPUs (docs/simulate.md)
    # Recovery per path, at scale.
    restart_in_place_s: float = 60.0  # torchrun (or an in-job restarter) restarts the workers
    spare_swap_s: float = 75.0  # a new rendezvous round with the spare, NCCL init included
    requeue_delay_s: float = 120.0  # Slurm's before a requeued job may start
    queue_wait_s: float = 300.0
    job_startup_s: float = 300.0  # launch on every node, imports, NCCL init, checkpoint load
    # Detection.
    dead_peer_s: float = 10.0  # the agents' rendezvous drops a silent node
    gpu_report_s: float = 5.0  # the agent's GPU check reports an Xid
    slurmd_timeout_s: float = 300.0  # Slurm calls a silent node NOT_RESPONDING
    nccl_timeout_s: float = 600.0  # torch's process-group timeout ends a hung collective
    hang_deadline_s: float = 300.0  # slurmft.train's step deadline (an in-job restarter's too)
    poll_s: float = 5.0  # the daemon's control pass
    seed: int = 0

    def with_(self, **changes: object) -> Inputs:
        return replace(self, **changes)  # type: ignore[arg-type]

    def with_settings(self, pairs: Sequence[str]) -> Inputs:
        """``name=value`` pairs applied to the numeric inputs (`slurmft simulate --input`):
        every input is a parameter. A bad name or value is a clear error."""
        settable = numeric_inputs()
        changes: dict[str, object] = {}
        for pair in pairs:
            name, sep, text = pair.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in settable:
                raise BadInput(
                    f"--input {pair!r}: expected NAME=NUMBER with NAME one of "
                    f"{', '.join(sorted(settable))}"
                )
            try:
                value = float(text) if settable[name] is float else int(text)
            except ValueError:
                raise BadInput(f"--input {pair!r}: {text!r} is not a number") from None
            if value < 0 or not math.isfinite(value) or (value == 0 and name in _POSITIVE):
                least = "> 0" if name in _POSITIVE else ">= 0"
                raise BadInput(f"--input {pair!r}: must be a finite number {least}")
            changes[name] = value
        return self.with_(**changes)

    @property
    def pool(self) -> int:
        if self.pool_nodes is not None:
            return self.pool_nodes
        return max(2, math.ceil(0.05 * (self.nodes + self.spares)))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def interval_s(self) -> float:
        """The checkpoint interval: as given, else Young/Daly's for the job's failure rate."""
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_interval_s
        return daly_interval_s(self.checkpoint_cost_s, self.rates.mtbf_s(self.nodes))


class BadInput(SlurmftError):
    """An input of the simulator named or valued wrongly."""


# Set by `--input` are the numbers, not the structure (nodes, spares, strategy, seed and the
# rate table have options of their own).
_STRUCTURE = frozenset({"nodes", "gpus_per_node", "spares", "seed", "horizon_s", "failure_every_s"})
_POSITIVE = frozenset({"poll_s", "rack_nodes", "checkpoint_interval_s"})


def numeric_inputs() -> dict[str, type]:
    """The inputs `with_settings` may set, with their number type."""
    out: dict[str, type] = {}
    for f in fields(Inputs):
        kind = str(f.type).split(" | ")[0]
        if f.name not in _STRUCTURE and kind in {"float", "int"}:
            out[f.name] = float if kind == "float" else int
    return out


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) first-order optimum sqrt(2 C M) - C, for C < 2 M (Young 1974 without the
    -C); past that, M. Below one second of cost it is Young's."""
    if not math.isfinite(mtbf_s):
        return math.inf
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    return max(math.sqrt(2 * cost_s * mtbf_s) - cost_s, 1.0)


def meta_like_inputs(base: Inputs) -> Inputs:
    """Llama 3's setting as far as the paper gives it: every interruption requeues the job (no
    spares, no in-job restart), on the team's own cluster (no queue wait). The paper gives no
    checkpoint cadence: a 3 s asynchronous checkpoint every 5 minutes, near Young/Daly's
    optimum for their failure rate."""
    return base.with_(
        strategy=Strategy.REQUEUE,
        spares=0,
        queue_wait_s=0.0,
        checkpoint_cost_s=3.0,
        checkpoint_interval_s=300.0,
    )
