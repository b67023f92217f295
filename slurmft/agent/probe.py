"""The GPU preflight seam. The NVML probe (slurmft.gpu) implements `Probe`; here there is no GPU,
so `NoGpuProbe` says so and the agent carries on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuFault:
    """One finding that makes the node unfit to train (e.g. an Xid or uncorrectable ECC)."""

    message: str
    gpu_index: int | None = None
    xid: int | None = None


@dataclass(frozen=True)
class GpuReport:
    has_gpus: bool
    gpu_count: int = 0
    faults: tuple[GpuFault, ...] = ()
    note: str = ""

    @property
    def fit(self) -> bool:
        return not self.faults


class Probe(Protocol):
    def probe(self) -> GpuReport: ...


class NoGpuProbe:
    """A node without NVIDIA GPUs (or without NVML): nothing to check."""

    def probe(self) -> GpuReport:
        return GpuReport(has_gpus=False, note="no GPU on this node: GPU checks skipped")
