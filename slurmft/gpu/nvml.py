"""The NVML source (package nvidia-ml-py, module ``pynvml``, imported only when probing).

Per GPU: volatile uncorrected ECC count, remapped rows pending/failure, retired pages pending,
the driver's recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, where the installed
pynvml and driver have it), "GPU is lost", and clock-event reasons (thermal or power slowdown,
which explain a straggler); plus Xid critical-error events from an event thread. Every field
may be NotSupported on some GPU and is then skipped on its own. No driver or no GPU is the
"no GPU" status, never an error.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from slurmft.gpu.api import FaultAction, FaultKind, GpuFault, SourceReport, SourceStatus
from slurmft.gpu.kernel_log import normalize_bus
from slurmft.gpu.nvml_events import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    XidEventThread,
    error_code,
)
from slurmft.gpu.xids import classify_recovery_action, classify_xid

NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NO_GPU_CODES = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "no NVIDIA driver on this node (libnvidia-ml.so.1 not found)",
    NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
}
# Not supported here, or a function this driver predates: skip that one field.
_SKIP_CODES = {NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND}

# nvmlClocksEventReason* bits that slow a GPU down for thermal or power reasons. Idle, the
# application clock setting, sync boost and display clocks are normal and left out.
SLOWDOWN_REASONS: dict[int, str] = {
    0x04: "power cap",
    0x08: "hardware slowdown",
    0x20: "thermal slowdown (software)",
    0x40: "thermal slowdown (hardware)",
    0x80: "power brake",
}


class _GpuLost(Exception):
    """Raised inside one GPU's checks when NVML says the GPU is lost."""


class NvmlSource:
    name = "nvml"

    def __init__(self, nvml: Any = None, *, event_timeout_ms: int = 500) -> None:
        self._nvml = nvml  # a fake in tests; pynvml (imported lazily) otherwise
        self._event_timeout_ms = event_timeout_ms
        self._lock = threading.Lock()
        self._initialised = False
        self._status: SourceStatus | None = None
        self._reason = ""
        self._handles: dict[int, Any] = {}
        self._buses: dict[int, str] = {}
        self._names: dict[int, str] = {}
        self._events: dict[str, GpuFault] = {}
        self._event_count = 0
        self._thread: XidEventThread | None = None
        self._notes: list[str] = []
        self._current = -1  # the GPU being checked, for notes

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Initialise NVML and start the Xid event thread (no-op without a GPU)."""
        if not self._initialised:
            self._init()
        if self._status is None and self._thread is None and self._handles:
            self._thread = XidEventThread(
                self._nvml, self._handles, self._on_xid, self._on_lost, self._event_timeout_ms
            )
            try:
                self._thread.start()
            except self._nvml.NVMLError as exc:
                self._thread = None
                self._reason = f"no NVML Xid events: {exc}"

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        if self._initialised and self._status is None:
            # Shutting down a driver that went away: nothing to undo.
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
        self._initialised = False

    def bus_map(self) -> dict[str, int]:
        """PCI bus (``0000:3b:00``) -> NVML GPU index, for the kernel-log source."""
        return {bus: index for index, bus in self._buses.items()}

    def _init(self) -> None:
        self._initialised = True
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:  # not installed, or (seen) its ctypes unreadable
                self._status = SourceStatus.SKIPPED
                self._reason = f"cannot import pynvml (package nvidia-ml-py): {exc}"
                return
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            no_gpu = _NO_GPU_CODES.get(error_code(exc) or -1)
            self._status = SourceStatus.NO_GPU if no_gpu else SourceStatus.UNAVAILABLE
            self._reason = no_gpu or f"NVML could not start: {exc}"
            return
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            self._status, self._reason = SourceStatus.NO_GPU, "NVML sees no NVIDIA GPU"
        for index in range(count):
            self._open_device(index)

    def _open_device(self, index: int) -> None:
        nvml = self._nvml
        try:
            self._handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            self._events[f"open:{index}"] = _lost_or_unreachable(index, exc)
            return
        bus = self._optional(nvml.nvmlDeviceGetPciInfo, self._handles[index])
        if bus is not None:
            self._buses[index] = normalize_bus(_text(bus.busId))
        name = self._optional(nvml.nvmlDeviceGetName, self._handles[index])
        self._names[index] = _text(name) if name is not None else "NVIDIA GPU"

    def _optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    # --- events (called from the event thread) ---------------------------------------------

    def _on_xid(self, xid: int, gpu: int | None) -> None:
        verdict = classify_xid(xid)
        with self._lock:
            self._event_count += 1
            key = f"event:{self._event_count}"
            self._events[key] = GpuFault(
                FaultKind.XID, verdict.action, verdict.summary, "nvml", gpu=gpu, xid=xid,
                pci_bus=self._buses.get(gpu) if gpu is not None else None,
                detail=f"nvmlEventTypeXidCriticalError eventData={xid}",
                fault_class=verdict.fault_class, key=key,
            )

    def _on_lost(self) -> None:
        with self._lock:
            self._events["lost:wait"] = _gpu_lost(None, "nvmlEventSetWait_v2: GPU is lost")

    # --- check -----------------------------------------------------------------------------

    def check(self) -> SourceReport:
        self.start()
        if self._status is not None:
            return SourceReport(self.name, self._status, self._reason)
        faults: list[GpuFault] = []
        self._notes = list(self._thread.notes) if self._thread is not None else []
        for index, handle in self._handles.items():
            self._current = index
            try:
                faults.extend(self._device_faults(index, handle))
            except _GpuLost as lost:
                faults.append(_gpu_lost(index, str(lost)))
        with self._lock:
            faults.extend(self._events.values())
        gpus = [f"{i}: {self._names.get(i)} ({self._buses.get(i, '?')})" for i in self._handles]
        reason = "; ".join(filter(None, [self._reason, *self._notes]))
        return SourceReport(self.name, SourceStatus.OK, reason, faults, gpus)

    def _device_faults(self, index: int, handle: Any) -> Iterator[GpuFault]:
        yield from self._ecc(index, handle)
        yield from self._remapped_rows(index, handle)
        yield from self._retired_pages(index, handle)
        yield from self._recovery_action(index, handle)
        yield from self._clocks(index, handle)

    def _field(self, fn_name: str, *args: Any) -> Any:
        """One NVML call: None when this GPU/driver lacks it; _GpuLost when the GPU is gone."""
        fn = getattr(self._nvml, fn_name, None)
        if fn is None:
            return None  # an older pynvml without this function
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if error_code(exc) == NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost(f"{fn_name}: GPU is lost") from None
            if error_code(exc) in _SKIP_CODES:
                return None
            raise _Skip(f"{fn_name}: {exc}") from None

    def _ecc(self, index: int, handle: Any) -> Iterator[GpuFault]:
        nvml = self._nvml
        count = self._safe("nvmlDeviceGetTotalEccErrors", handle,
                           getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                           getattr(nvml, "NVML_VOLATILE_ECC", 0))
        if count:
            yield self._fault(index, FaultKind.ECC_UNCORRECTED, FaultAction.DRAIN,
                              f"uncorrected ECC errors: {int(count)}", f"ecc:{int(count)}")

    def _remapped_rows(self, index: int, handle: Any) -> Iterator[GpuFault]:
        rows = self._safe("nvmlDeviceGetRemappedRows", handle)
        if rows is None:
            return
        _corrected, _uncorrected, pending, failure = rows
        if pending:
            yield self._fault(index, FaultKind.REMAP_PENDING, FaultAction.DRAIN,
                              "row remap pending (GPU reset needed)", "remap:pending")
        if failure:
            yield self._fault(index, FaultKind.REMAP_FAILURE, FaultAction.DRAIN,
                              "row remap failure", "remap:failure")

    def _retired_pages(self, index: int, handle: Any) -> Iterator[GpuFault]:
        if self._safe("nvmlDeviceGetRetiredPagesPendingStatus", handle):
            yield self._fault(index, FaultKind.RETIRED_PAGES_PENDING, FaultAction.DRAIN,
                              "retired pages pending (GPU reset needed)", "pages:pending")

    def _recovery_action(self, index: int, handle: Any) -> Iterator[GpuFault]:
        field_id = getattr(self._nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return  # pynvml older than the field: nothing to ask
        values = self._safe("nvmlDeviceGetFieldValues", handle, [field_id])
        if not values or values[0].nvmlReturn != NVML_SUCCESS:
            return  # the driver predates the field, or this GPU does not report it
        value = int(values[0].value.uiVal)
        action, summary = classify_recovery_action(value)
        if action is not FaultAction.RECORD:
            fault = self._fault(index, FaultKind.RECOVERY_ACTION, action, summary,
                                f"recovery:{value}")
            yield replace(fault, code=value)

    def _clocks(self, index: int, handle: Any) -> Iterator[GpuFault]:
        reasons = self._safe("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is None:  # drivers before the rename only have the deprecated name
            reasons = self._safe("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        slow = [name for bit, name in SLOWDOWN_REASONS.items() if (reasons or 0) & bit]
        if slow:
            yield self._fault(index, FaultKind.CLOCK_SLOWDOWN, FaultAction.RECORD,
                              "clocks slowed: " + ", ".join(slow), f"clocks:{int(reasons or 0):#x}")

    def _safe(self, fn_name: str, *args: Any) -> Any:
        try:
            return self._field(fn_name, *args)
        except _Skip as exc:  # an unexpected error on one field: say so, check the rest
            self._notes.append(f"GPU {self._current}: {exc}")
            return None

    def _fault(self, index: int, kind: FaultKind, action: FaultAction, summary: str,
               key: str) -> GpuFault:
        return GpuFault(kind, action, summary, "nvml", gpu=index, pci_bus=self._buses.get(index),
                        detail=summary, key=key)


class _Skip(Exception):
    """An NVML field failed for a reason other than NotSupported or a lost GPU: skip it."""


def _gpu_lost(index: int | None, detail: str) -> GpuFault:
    return GpuFault(FaultKind.GPU_LOST, FaultAction.DRAIN, "GPU is lost", "nvml", gpu=index,
                    detail=detail, key="lost")


def _lost_or_unreachable(index: int, exc: BaseException) -> GpuFault:
    if error_code(exc) == NVML_ERROR_GPU_IS_LOST:
        return _gpu_lost(index, f"nvmlDeviceGetHandleByIndex({index}): GPU is lost")
    # Seen on dying GPUs ("Unable to determine the device handle ... Unknown Error"), but also
    # on transient driver trouble: recorded for a human, not a drain on its own.
    return GpuFault(FaultKind.GPU_UNREACHABLE, FaultAction.RECORD, "GPU not reachable by NVML",
                    "nvml",
                    gpu=index, detail=f"nvmlDeviceGetHandleByIndex({index}): {exc}",
                    key=f"unreachable:{error_code(exc)}")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
