"""Fault injection: a probe source driven by a file or a setting, for tests and drills.

``gpu.inject`` (environment ``SLURMFT_GPU_INJECT``) is either a path to a file or the faults
themselves. One fault per line (``;`` also separates them inline), as JSON or as ``key=value``
pairs::

    xid=79,gpu=3
    {"xid": 13, "gpu": 0, "message": "Graphics SM Warp Exception"}
    kind=ecc_uncorrected,gpu=1,count=2
    kind=remap_pending,gpu=0        kind=recovery_action,gpu=2,value=2
    kind=gpu_lost,gpu=5             kind=clock_slowdown,gpu=0,reasons=0x40

A ``node=n2`` pair limits a line to that node (``$SLURMD_NODENAME``, else the host name): on
the local Slurm cluster every emulated node shares one host and one environment, so this is
how a test makes exactly one of them report the fault.

Injected Xids go through the same classification table as real ones. The file is reread on
every check, so a test can append a line while an agent runs and see it streamed.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from slurmft.gpu.api import FaultAction, FaultKind, GpuFault, SourceReport, SourceStatus
from slurmft.gpu.xids import CONDITION_ACTIONS, classify_recovery_action, classify_xid

_CONDITIONS: dict[str, tuple[FaultKind, FaultAction, str]] = {
    "remap_pending": (FaultKind.REMAP_PENDING, CONDITION_ACTIONS[FaultKind.REMAP_PENDING],
                      "row remap pending (GPU reset needed)"),
    "remap_failure": (FaultKind.REMAP_FAILURE, CONDITION_ACTIONS[FaultKind.REMAP_FAILURE],
                      "row remap failure"),
    "retired_pages_pending": (FaultKind.RETIRED_PAGES_PENDING,
                              CONDITION_ACTIONS[FaultKind.RETIRED_PAGES_PENDING],
                              "retired pages pending (GPU reset needed)"),
    "gpu_lost": (FaultKind.GPU_LOST, CONDITION_ACTIONS[FaultKind.GPU_LOST], "GPU is lost"),
}


class InjectionError(ValueError):
    """An injection line that cannot be understood; the message names the line."""


def parse_spec_line(line: str) -> dict[str, Any]:
    line = line.strip()
    if line.startswith("{"):
        data = json.loads(line)
        if not isinstance(data, dict):
            raise InjectionError(f"expected a JSON object: {line}")
        return data
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in line.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise InjectionError(f"expected key=value, got {part!r}")
        fields[key.strip()] = value.strip()
    return fields


def fault_from_spec(spec: dict[str, Any], key: str) -> GpuFault:
    kind = str(spec.get("kind", "xid" if "xid" in spec else ""))
    gpu = int(spec["gpu"]) if spec.get("gpu") not in (None, "") else None
    detail = f"injected: {json.dumps(spec, sort_keys=True)}"
    if kind == "xid":
        xid = int(spec["xid"])
        verdict = classify_xid(xid, str(spec.get("message", "")))
        return GpuFault(FaultKind.XID, verdict.action, verdict.summary, "inject", gpu=gpu,
                        xid=xid, detail=detail, fault_class=verdict.fault_class, key=key)
    if kind in ("ecc", "ecc_uncorrected"):
        count = int(spec.get("count", 1))
        return GpuFault(FaultKind.ECC_UNCORRECTED, FaultAction.DRAIN,
                        f"uncorrected ECC errors: {count}", "inject", gpu=gpu, detail=detail,
                        key=key)
    if kind == "recovery_action":
        value = int(spec.get("value", 1))
        action, summary = classify_recovery_action(value)
        return GpuFault(FaultKind.RECOVERY_ACTION, action, summary, "inject", gpu=gpu,
                        detail=detail, key=key, code=value)
    if kind == "clock_slowdown":
        return GpuFault(FaultKind.CLOCK_SLOWDOWN, FaultAction.RECORD,
                        f"clocks slowed: {spec.get('reasons', 'thermal')}", "inject", gpu=gpu,
                        detail=detail, key=key)
    if kind in _CONDITIONS:
        fault_kind, action, summary = _CONDITIONS[kind]
        return GpuFault(fault_kind, action, summary, "inject", gpu=gpu, detail=detail, key=key)
    raise InjectionError(f"unknown kind {kind!r} (xid, ecc_uncorrected, {', '.join(_CONDITIONS)}, "
                         "recovery_action, clock_slowdown)")


class InjectionSource:
    name = "inject"

    def __init__(self, spec: str, *, node_name: str | None = None) -> None:
        self._spec = spec
        self._node = node_name or os.environ.get("SLURMD_NODENAME") or socket.gethostname()

    def start(self) -> None:
        """Nothing runs in the background: the spec is reread on every check."""

    def close(self) -> None:
        """Nothing to stop."""

    def _lines(self) -> list[str]:
        path = Path(self._spec)
        if "/" in self._spec or path.is_file():
            try:
                return path.read_text().splitlines()
            except FileNotFoundError:
                return []  # the test has not written its first fault yet
        return self._spec.split(";")

    def check(self) -> SourceReport:
        faults: list[GpuFault] = []
        errors: list[str] = []
        for number, line in enumerate(self._lines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                spec = parse_spec_line(line)
                if str(spec.pop("node", self._node)) != self._node:
                    continue  # meant for another node
                faults.append(fault_from_spec(spec, f"line:{number}"))
            except (ValueError, KeyError) as exc:  # JSON, int() and InjectionError
                errors.append(f"line {number}: {exc}")
        if errors:
            return SourceReport(self.name, SourceStatus.UNAVAILABLE,
                                "bad injection spec: " + "; ".join(errors), faults)
        return SourceReport(self.name, SourceStatus.OK, f"injecting from {self._spec}", faults)
