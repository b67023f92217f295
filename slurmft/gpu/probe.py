"""The GPU probe: every source merged into one report; new faults handed out once each."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from slurmft.config import Config, GpuSection
from slurmft.gpu.api import (
    FaultAction,
    GpuFault,
    ProbeSource,
    SourceReport,
    SourceStatus,
)
from slurmft.gpu.dcgm import DcgmSource
from slurmft.gpu.inject import InjectionSource
from slurmft.gpu.kmsg import KernelLogSource
from slurmft.gpu.nvml import NvmlSource

log = logging.getLogger(__name__)


@dataclass
class ProbeReport:
    sources: list[SourceReport] = field(default_factory=list)

    @property
    def faults(self) -> list[GpuFault]:
        return [fault for source in self.sources for fault in source.faults]

    @property
    def action(self) -> FaultAction:
        """The most severe action any fault asks for (RECORD when there is none)."""
        return max((f.action for f in self.faults), key=lambda a: a.severity,
                   default=FaultAction.RECORD)

    @property
    def drain_faults(self) -> list[GpuFault]:
        return [f for f in self.faults if f.action is FaultAction.DRAIN]

    @property
    def no_gpu(self) -> bool:
        """True when NVML found no driver or no GPU (injected faults still show)."""
        return any(s.source == "nvml" and s.status is SourceStatus.NO_GPU for s in self.sources)

    @property
    def gpu_count(self) -> int:
        return sum(len(s.gpus) for s in self.sources if s.source == "nvml")

    @property
    def no_gpu_reason(self) -> str:
        return next((s.reason for s in self.sources if s.status is SourceStatus.NO_GPU), "")

    def drain_reason(self) -> str | None:
        """The Slurm reason for the first drain-class fault; None when the node may stay."""
        drains = self.drain_faults
        if not drains:
            return None
        more = f" (+{len(drains) - 1} more)" if len(drains) > 1 else ""
        return drains[0].drain_reason() + more

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_present": not self.no_gpu,
            "gpu_count": self.gpu_count,
            "no_gpu_reason": self.no_gpu_reason,
            "action": str(self.action),
            "drain_reason": self.drain_reason(),
            "sources": [s.to_dict() for s in self.sources],
            "faults": [f.to_dict() for f in self.faults],
        }


class GpuProbe:
    """Preflight with ``check()``; stream with ``new_faults()`` or ``watch()``; then ``close()``."""

    def __init__(self, sources: Sequence[ProbeSource]) -> None:
        self.sources = list(sources)
        self._reported: set[tuple[Any, ...]] = set()
        self._started = False

    @classmethod
    def default(
        cls,
        *,
        since_monotonic_s: float | None = None,
        kernel_log_file: Path | None = None,
        inject: str = GpuSection.inject,
        use_dcgm: bool = GpuSection.dcgm,
        nvml: Any = None,
    ) -> GpuProbe:
        """NVML, the kernel log, DCGM (where installed) and injection (where configured)."""
        nvml_source = NvmlSource(nvml)
        sources: list[ProbeSource] = [
            nvml_source,
            KernelLogSource(since_monotonic_s=since_monotonic_s, file_path=kernel_log_file,
                            bus_map=nvml_source.bus_map),
        ]
        if use_dcgm:
            sources.append(DcgmSource())
        if inject:
            sources.append(InjectionSource(inject))
        return cls(sources)

    @classmethod
    def from_config(cls, config: Config, *, since_monotonic_s: float | None = None) -> GpuProbe:
        """The probe a node runs, from the ``gpu.*`` settings."""
        gpu = config.settings.gpu
        return cls.default(
            since_monotonic_s=since_monotonic_s,
            kernel_log_file=Path(gpu.kernel_log_file) if gpu.kernel_log_file else None,
            inject=gpu.inject,
            use_dcgm=gpu.dcgm,
        )

    def start(self) -> None:
        if not self._started:
            for source in self.sources:
                source.start()
            self._started = True

    def check(self) -> ProbeReport:
        """What every source sees now (the preflight question)."""
        self.start()
        return ProbeReport([source.check() for source in self.sources])

    def new_faults(self) -> list[GpuFault]:
        """Faults not handed out before: call it every few seconds to stream them."""
        fresh = []
        for fault in self.check().faults:
            if fault.identity() not in self._reported:
                self._reported.add(fault.identity())
                fresh.append(fault)
        return fresh

    def watch(self, on_fault: Callable[[GpuFault], None], stop: threading.Event,
              interval_s: float = GpuSection.poll_interval_s) -> threading.Thread:
        """Call ``on_fault`` for each new fault until ``stop`` is set (a daemon thread)."""

        def loop() -> None:
            while not stop.is_set():
                try:
                    for fault in self.new_faults():
                        on_fault(fault)
                except Exception:  # a broken source must not end the watch for the others
                    log.exception("GPU probe check failed; retrying in %.0f s", interval_s)
                stop.wait(interval_s)

        thread = threading.Thread(target=loop, name="slurmft-gpu-watch", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        for source in self.sources:
            source.close()
        self._started = False

    def __enter__(self) -> GpuProbe:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
