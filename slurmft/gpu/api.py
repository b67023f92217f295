"""The GPU probe's contract: what a source reports, and the protocol every source implements.

A source (NVML, the kernel log, DCGM, fault injection) answers one question, ``check()``: what
does it see now, including every event it has seen since it started. The probe merges sources
and hands new faults to its caller; sources never decide what happens to the node, the
classification table does (``slurmft.gpu.xids``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class FaultAction(enum.StrEnum):
    """What a fault asks of a training run, from mildest to most severe."""

    RECORD = "record"  # record only: the GPU is fine (NVIDIA: IGNORE, or an explanation)
    RESTART_APP = "restart_app"  # the run restarts, the node stays
    DRAIN = "drain"  # the node leaves the run and is drained until repaired

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {FaultAction.RECORD: 0, FaultAction.RESTART_APP: 1, FaultAction.DRAIN: 2}


class FaultKind(enum.StrEnum):
    XID = "xid"
    ECC_UNCORRECTED = "ecc_uncorrected"  # volatile uncorrected ECC count above zero
    REMAP_PENDING = "remap_pending"  # a row remap waits for a GPU reset
    REMAP_FAILURE = "remap_failure"  # a row could not be remapped
    RETIRED_PAGES_PENDING = "retired_pages_pending"  # a page retirement waits for a reset
    RECOVERY_ACTION = "recovery_action"  # the driver says the GPU needs reset/reboot/drain
    GPU_LOST = "gpu_lost"  # NVML: GPU is lost (fell off the bus)
    GPU_UNREACHABLE = "gpu_unreachable"  # NVML cannot open the GPU: recorded, not drained
    CLOCK_SLOWDOWN = "clock_slowdown"  # thermal or power slowdown: explains a straggler
    DCGM_HEALTH = "dcgm_health"  # a `dcgmi health` incident


class SourceStatus(enum.StrEnum):
    OK = "ok"  # the source ran and its faults are complete
    NO_GPU = "no_gpu"  # no NVIDIA driver or no GPU on this node: not a failure
    UNAVAILABLE = "unavailable"  # the source exists but cannot be read (permissions, errors)
    SKIPPED = "skipped"  # not installed or not configured here


@dataclass(frozen=True)
class GpuFault:
    """One thing a source saw on one GPU (``gpu`` None: the node or an unknown GPU)."""

    kind: FaultKind
    action: FaultAction
    summary: str  # short and human: "GPU fell off the bus"
    source: str  # "nvml", "kmsg", "dmesg", "file", "dcgm", "inject"
    gpu: int | None = None
    xid: int | None = None
    pci_bus: str | None = None  # normalised "0000:3b:00"
    detail: str = ""  # the raw line or value behind the fault
    fault_class: str = "hardware"  # a slurmft.db.models.FaultClass value
    # Identity for de-duplication: an event's sequence number, or a condition's value.
    key: str = ""
    monotonic_s: float | None = None  # kernel-log time (seconds since boot), where known
    # What the kind's classification reads besides the Xid: the NVML recovery action's value,
    # DCGM's health string ("Failure"). The daemon classifies (kind, xid, code, detail) again
    # itself (slurmft.gpu.xids.classify_fault): an agent's word on the action is not taken.
    code: int | str | None = None

    def drain_reason(self) -> str:
        """The Slurm drain reason: ``slurmft: Xid 79 GPU fell off the bus (GPU 3)``."""
        head = f"Xid {self.xid} {self.summary}" if self.xid is not None else self.summary
        where = f"GPU {self.gpu}" if self.gpu is not None else self.pci_bus
        return f"slurmft: {head} ({where})" if where else f"slurmft: {head}"

    def identity(self) -> tuple[Any, ...]:
        return (self.source, self.kind, self.gpu, self.xid, self.key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "action": str(self.action),
            "summary": self.summary,
            "source": self.source,
            "gpu": self.gpu,
            "xid": self.xid,
            "pci_bus": self.pci_bus,
            "detail": self.detail,
            "fault_class": self.fault_class,
            "code": self.code,
            "drain_reason": self.drain_reason(),
        }


@dataclass
class SourceReport:
    """What one source saw: its status, why (when not OK), and its faults."""

    source: str
    status: SourceStatus
    reason: str = ""
    faults: list[GpuFault] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)  # "0: NVIDIA H100 (0000:3b:00)", for humans

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "status": str(self.status),
            "reason": self.reason,
            "gpus": list(self.gpus),
            "faults": [f.to_dict() for f in self.faults],
        }


@runtime_checkable
class ProbeSource(Protocol):
    """One way of looking at the GPUs. ``check`` must never raise for a missing GPU/driver."""

    name: str

    def start(self) -> None:
        """Begin background work (an event thread), if the source has any."""

    def check(self) -> SourceReport:
        """Current conditions plus every event seen since the source started."""

    def close(self) -> None:
        """Stop background work; safe to call twice."""
