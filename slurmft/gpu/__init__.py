"""GPU health: NVML, kernel-log Xids and DCGM, classified by one table (docs/gpu.md).

Importing this package never loads ``pynvml``, the driver or torch: NVML is imported when a
probe first checks, so a node without the NVIDIA driver imports it fine and reports "no GPU".

How the node agent uses it::

    from slurmft.gpu import FaultAction, GpuProbe

    probe = GpuProbe.from_config(config, since_monotonic_s=agent_start_monotonic)
    report = probe.check()                    # preflight
    if report.drain_reason():                 # a drain-class condition: refuse this node
        exit_with(report.drain_reason())      # "slurmft: Xid 79 GPU fell off the bus (GPU 3)"
    ...
    for fault in probe.new_faults():          # every few seconds during the run
        send(fault.to_dict())                 # fault.action: drain / restart_app / record
    probe.close()                             # stops the NVML event thread

or ``probe.watch(on_fault, stop_event, interval_s)`` for a thread that does the loop.

- ``GpuProbe.check() -> ProbeReport``: every source's status and faults; ``report.no_gpu`` /
  ``no_gpu_reason`` when the node has no NVIDIA driver or GPU (not a failure);
  ``report.action`` the most severe ``FaultAction``; ``report.drain_reason()``.
- ``GpuProbe.new_faults() -> list[GpuFault]``: faults not handed out before.
- ``GpuFault``: kind, action, summary, source, gpu, xid, pci_bus, detail, fault_class (a
  ``slurmft.db.models.FaultClass`` value), ``drain_reason()``, ``to_dict()``.
- ``ProbeSource``: the protocol (``name``, ``start``, ``check -> SourceReport``, ``close``);
  sources: ``NvmlSource``, ``KernelLogSource``, ``DcgmSource``, ``InjectionSource``.
- ``classify_xid(xid, message="") -> XidVerdict`` and ``XID_TABLE``: the one table.
- ``judge_lemons(history, now=...) -> {node: LemonVerdict}``: restart-class Xids (13, 31, 43)
  make a lemon only across different runs.
"""

from typing import TYPE_CHECKING

from slurmft._lazy import lazy_exports

if TYPE_CHECKING:
    from slurmft.gpu.api import (
        FaultAction,
        FaultKind,
        GpuFault,
        ProbeSource,
        SourceReport,
        SourceStatus,
    )
    from slurmft.gpu.dcgm import DcgmSource, parse_dcgmi_health
    from slurmft.gpu.inject import InjectionSource
    from slurmft.gpu.kernel_log import XidParser, XidRecord, parse_xid_lines
    from slurmft.gpu.kmsg import KernelLogSource
    from slurmft.gpu.lemons import LemonVerdict, XidOccurrence, judge_lemons
    from slurmft.gpu.nvml import NvmlSource
    from slurmft.gpu.probe import GpuProbe, ProbeReport
    from slurmft.gpu.xids import APPLICATION_XIDS, XID_TABLE, XidVerdict, classify_xid

_EXPORTS = {
    "FaultAction": "api",
    "FaultKind": "api",
    "GpuFault": "api",
    "ProbeSource": "api",
    "SourceReport": "api",
    "SourceStatus": "api",
    "DcgmSource": "dcgm",
    "parse_dcgmi_health": "dcgm",
    "InjectionSource": "inject",
    "XidParser": "kernel_log",
    "XidRecord": "kernel_log",
    "parse_xid_lines": "kernel_log",
    "KernelLogSource": "kmsg",
    "LemonVerdict": "lemons",
    "XidOccurrence": "lemons",
    "judge_lemons": "lemons",
    "NvmlSource": "nvml",
    "GpuProbe": "probe",
    "ProbeReport": "probe",
    "APPLICATION_XIDS": "xids",
    "XID_TABLE": "xids",
    "XidVerdict": "xids",
    "classify_xid": "xids",
}

__all__ = [
    "APPLICATION_XIDS",
    "XID_TABLE",
    "DcgmSource",
    "FaultAction",
    "FaultKind",
    "GpuFault",
    "GpuProbe",
    "InjectionSource",
    "KernelLogSource",
    "LemonVerdict",
    "NvmlSource",
    "ProbeReport",
    "ProbeSource",
    "SourceReport",
    "SourceStatus",
    "XidOccurrence",
    "XidParser",
    "XidRecord",
    "XidVerdict",
    "classify_xid",
    "judge_lemons",
    "parse_dcgmi_health",
    "parse_xid_lines",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
