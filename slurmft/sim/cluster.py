"""The simulated partition: its nodes, their racks, what broke, what is drained, and the failure
draws. World behaviour only: what slurmft decides about these nodes comes from the real policy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slurmft.sim.inputs import HOUR, Hit, Inputs


@dataclass
class Node:
    name: str
    rack: int
    lemon: bool
    dead_since: float | None = None  # silent: slurmd and agent (power, NIC, switch...)
    gpu_fault_at: float | None = None  # a drain-class GPU fault; the node still answers
    down_at: float | None = None  # DOWN in Slurm (set DOWN, or silent past SlurmdTimeout)
    drained_at: float | None = None  # drained (by slurmft or the site's health check)
    repair_due: float | None = None
    slow_until: float = -math.inf  # a straggler until then

    @property
    def broken(self) -> bool:
        return self.dead_since is not None or self.gpu_fault_at is not None

    def slow(self, now: float) -> bool:
        return now < self.slow_until


class Partition:
    """Every node of the partition: the job's nodes and the pool a requeue may take from."""

    def __init__(self, inputs: Inputs, rng: random.Random) -> None:
        total = inputs.nodes + inputs.spares + inputs.pool
        rack = max(1, inputs.rack_nodes)
        self.nodes = [
            Node(f"n{i:05d}", i // rack, rng.random() < inputs.lemon_share) for i in range(total)
        ]
        self.by_name = {n.name: n for n in self.nodes}

    def __getitem__(self, name: str) -> Node:
        return self.by_name[name]

    def rack(self, rack: int) -> list[Node]:
        return [n for n in self.nodes if n.rack == rack]

    def usable(self, exclude: Iterable[str]) -> list[str]:
        """Nodes a new job may get: whole, not drained, not DOWN, not excluded; Slurm hands
        out the lowest-numbered first (contiguous, as its topology-aware selection tends to)."""
        out = set(exclude)
        return [
            n.name
            for n in self.nodes
            if not n.broken and n.drained_at is None and n.down_at is None and n.name not in out
        ]

    def drained(self) -> int:
        return sum(1 for n in self.nodes if n.drained_at is not None)

    def repair(self, node: Node) -> None:
        """Back in the partition: fixed, undrained, up."""
        node.dead_since = node.gpu_fault_at = node.down_at = node.drained_at = None
        node.repair_due = None
        node.slow_until = -math.inf


@dataclass(frozen=True)
class Failure:
    at: float
    hit: Hit | None  # None: a straggler
    node: str = ""  # the node hit (GPU, NODE, SOFTWARE, straggler); "" for a hang
    rack: int = -1  # SWITCH: every node of it


class FailureDraws:
    """Failures as one Poisson process over what the job holds now: node-level classes on every
    node of its allocation (spares too; lemons at ``lemon_factor`` times the rate, the rest lower
    so that the partition's mean stays the table's), switches on every rack it touches, software
    bugs and hangs on the nodes that train, stragglers on every node. Memoryless, so it is drawn
    anew whenever what the job holds changes."""

    def __init__(self, inputs: Inputs, rng: random.Random) -> None:
        self.inputs, self.rng = inputs, rng
        rates = inputs.rates
        per_s = 1.0 / HOUR
        switch_causes = [n for n in rates.per_node_hour if "switch" in n.lower()]
        switch = inputs.switch_share * sum(rates.per_node_hour[n] for n in switch_causes)
        lemon_mean = 1.0 - inputs.lemon_share + inputs.lemon_share * inputs.lemon_factor
        self.gpu = rates.rate(Hit.GPU) * per_s / lemon_mean
        self.node = (rates.rate(Hit.NODE) - switch) * per_s / lemon_mean
        self.switch_per_rack = (rates.rate(Hit.SWITCH) + switch) * per_s * inputs.rack_nodes
        self.software = rates.rate(Hit.SOFTWARE) * per_s
        self.hang = rates.rate(Hit.HANG) * per_s
        self.straggler = inputs.stragglers_per_node_day / 86400.0

    def next(
        self, now: float, allocation: Sequence[Node], members: Sequence[str]
    ) -> Failure | None:
        if self.inputs.failure_every_s is not None:
            return None  # the fixed schedule replaces the draws
        weights = [self.inputs.lemon_factor if n.lemon else 1.0 for n in allocation]
        weight = sum(weights)
        racks = sorted({n.rack for n in allocation})
        parts = [
            (Hit.GPU, self.gpu * weight),
            (Hit.NODE, self.node * weight),
            (Hit.SWITCH, self.switch_per_rack * len(racks)),
            (Hit.SOFTWARE, self.software * len(members)),
            (Hit.HANG, self.hang * len(members)),
            (None, self.straggler * len(allocation)),
        ]
        total = sum(rate for _, rate in parts)
        if total <= 0 or not allocation:
            return None
        at = now + self.rng.expovariate(total)
        hit = self.rng.choices([h for h, _ in parts], weights=[r for _, r in parts])[0]
        if hit is Hit.SWITCH:
            return Failure(at, hit, rack=self.rng.choice(racks))
        if hit is Hit.HANG:
            return Failure(at, hit)
        if hit is Hit.SOFTWARE:
            return Failure(at, hit, node=self.rng.choice(members))
        if hit in (Hit.GPU, Hit.NODE):
            return Failure(at, hit, node=self.rng.choices(allocation, weights=weights)[0].name)
        return Failure(at, hit, node=self.rng.choice(allocation).name)
