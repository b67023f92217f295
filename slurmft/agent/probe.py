"""The GPU preflight seam. The NVML probe (slurmft.gpu) implements `Probe`; here there is no GPU,
so `NoGpuProbe` says so and the agent carries on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from slurmft.gpu.probe import GpuProbe


@dataclass(frozen=True)
class GpuFault:
    """One finding that makes the node unfit to train (e.g. an Xid or uncorrectable ECC)."""

    message: str
    gpu_index: int | None = None
    xid: int | None = None
    kind: str = ""  # a slurmft.gpu.api.FaultKind value: with the code, what the daemon reads
    code: int | str | None = None
    detail: str = ""  # the driver's line or value behind it


@dataclass(frozen=True)
class GpuReport:
    has_gpus: bool
    gpu_count: int = 0
    faults: tuple[GpuFault, ...] = ()
    note: str = ""

    @property
    def fit(self) -> bool:
        return not self.faults


@dataclass(frozen=True)
class RunGpuFault:
    """A GPU fault seen during the run, with what the classification table says it calls for
    (``drain``, ``restart_app`` or ``record``): the daemon acts on it."""

    message: str
    action: str
    gpu_index: int | None = None
    xid: int | None = None
    fault_class: str = "hardware"
    # What the daemon classifies on its side (slurmft.gpu.xids.classify_fault): the agent's
    # ``action`` is for its own log and the record, never what the daemon acts on.
    kind: str = ""
    code: int | str | None = None
    detail: str = ""


class Probe(Protocol):
    def probe(self) -> GpuReport: ...

    def new_faults(self) -> list[RunGpuFault]:
        """Faults not reported before (polled during the run)."""
        ...


class NoGpuProbe:
    """A node without NVIDIA GPUs (or without NVML): nothing to check."""

    def probe(self) -> GpuReport:
        return GpuReport(has_gpus=False, note="no GPU on this node: GPU checks skipped")

    def new_faults(self) -> list[RunGpuFault]:
        return []


class NodeGpuProbe:
    """The node's GPU health (slurmft.gpu: NVML, kernel-log Xids, DCGM, injection) as the
    preflight sees it: only drain-class conditions make the node unfit. Restart-class faults
    are the run's business, not the node's, and do not keep it out."""

    def __init__(self, gpu_probe: GpuProbe) -> None:
        self.gpu_probe = gpu_probe

    def probe(self) -> GpuReport:
        report = self.gpu_probe.check()
        faults = tuple(
            GpuFault(f.drain_reason(), f.gpu, f.xid, f.kind.value, f.code, f.detail)
            for f in report.drain_faults
        )
        # Injected faults show even where there is no GPU: a test drives an emulated node so.
        return GpuReport(
            has_gpus=not report.no_gpu,
            gpu_count=report.gpu_count,
            faults=faults,
            note=report.no_gpu_reason if report.no_gpu else "",
        )

    def new_faults(self) -> list[RunGpuFault]:
        return [
            RunGpuFault(
                f.drain_reason().removeprefix("slurmft: "),
                f.action.value,
                f.gpu,
                f.xid,
                f.fault_class,
                f.kind.value,
                f.code,
                f.detail,
            )
            for f in self.gpu_probe.new_faults()
        ]
