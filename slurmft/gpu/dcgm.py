"""The DCGM source: ``dcgmi health -c -j`` where DCGM is installed; skipped where it is not.

Output shape (NVIDIA/DCGM dcgmi/Health.cpp and DcgmiOutput.h): ``{"header": ["Health Monitor
Report"], "body": {"Overall Health": {"value": "Warning"}, "GPU": {"children": {"1": {"value":
"Failure", "children": {"Errors": {"children": {"Memory system": {"value": "Failure",
"overflow": ["message in", "54-character pieces"]}}}}}}}}}``. Health strings are Healthy,
Warning, Failure. A Failure drains (DCGM saw the GPU fail a watched system); a Warning is
recorded. DCGM needs its health watches enabled by the site (``dcgmi health -s a``); this
source only reads them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

from slurmft.gpu.api import FaultKind, GpuFault, SourceReport, SourceStatus
from slurmft.gpu.xids import DCGM_HEALTH_ACTIONS

Runner = Callable[..., subprocess.CompletedProcess[str]]


def parse_dcgmi_health(text: str) -> list[GpuFault]:
    """Faults from ``dcgmi health -c -j`` output; Healthy entities give none."""
    body = json.loads(text).get("body", {})
    entities = body.get("GPU", {}).get("children", {})
    return [fault for gpu_id, node in entities.items() for fault in _entity(gpu_id, node)]


def _entity(gpu_id: str, node: dict[str, Any]) -> Iterator[GpuFault]:
    systems = node.get("children", {}).get("Errors", {}).get("children", {})
    for system, entry in systems.items():
        health = entry.get("value", "")
        action = DCGM_HEALTH_ACTIONS.get(health)
        if action is None:
            continue
        message = " ".join(entry.get("overflow", []))
        yield GpuFault(
            FaultKind.DCGM_HEALTH, action, f"DCGM {system} {health.lower()}", "dcgm",
            gpu=int(gpu_id) if gpu_id.isdigit() else None, detail=message,
            key=f"dcgm:{system}:{health}", code=health,
        )


class DcgmSource:
    name = "dcgm"

    def __init__(self, *, run: Runner = subprocess.run,
                 which: Callable[[str], str | None] = shutil.which, timeout_s: float = 30) -> None:
        self._run = run
        self._which = which
        self._timeout_s = timeout_s

    def start(self) -> None:
        """Nothing runs in the background: each check asks DCGM once."""

    def close(self) -> None:
        """Nothing to stop."""

    def check(self) -> SourceReport:
        if self._which("dcgmi") is None:
            return SourceReport(self.name, SourceStatus.SKIPPED, "DCGM is not installed")
        try:
            done = self._run(["dcgmi", "health", "-c", "-j"], capture_output=True, text=True,
                             timeout=self._timeout_s)
        except (OSError, subprocess.SubprocessError) as exc:
            return SourceReport(self.name, SourceStatus.UNAVAILABLE, f"dcgmi failed: {exc}")
        if "watches not enabled" in done.stdout:
            return SourceReport(self.name, SourceStatus.SKIPPED,
                                "DCGM health watches are not enabled (dcgmi health -s a)")
        if done.returncode != 0:
            why = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            return SourceReport(self.name, SourceStatus.UNAVAILABLE, f"dcgmi: {why[0]}")
        try:
            faults = parse_dcgmi_health(done.stdout)
        except (ValueError, AttributeError) as exc:
            return SourceReport(self.name, SourceStatus.UNAVAILABLE,
                                f"unreadable dcgmi output: {exc}")
        return SourceReport(self.name, SourceStatus.OK, "", faults)
