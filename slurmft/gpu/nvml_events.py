"""The NVML Xid event thread: ``nvmlEventSetWait_v2`` with a short timeout, in a loop.

The wait blocks inside the driver; a short timeout is what lets ``stop()`` end the thread
within one timeout instead of never (an Xid may not come for weeks).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError


def error_code(exc: BaseException) -> int | None:
    """The NVML return code carried by a pynvml NVMLError (``.value``)."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class XidEventThread:
    """Registers every device for Xid critical errors and reports each event to ``on_event``.

    ``on_event(xid, gpu_index_or_None)``; ``on_lost()`` when the wait itself says a GPU is lost.
    """

    def __init__(
        self,
        nvml: Any,
        handles: dict[int, Any],
        on_event: Callable[[int, int | None], None],
        on_lost: Callable[[], None],
        timeout_ms: int = 500,
    ) -> None:
        self._nvml = nvml
        self._handles = handles
        self._on_event = on_event
        self._on_lost = on_lost
        self._timeout_ms = timeout_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.registered: list[int] = []
        self.notes: list[str] = []

    def start(self) -> None:
        nvml = self._nvml
        self._event_set = nvml.nvmlEventSetCreate()
        kind = getattr(nvml, "nvmlEventTypeXidCriticalError", XID_CRITICAL_ERROR)
        for index, handle in self._handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, kind, self._event_set)
                self.registered.append(index)
            except nvml.NVMLError as exc:  # NotSupported on some GPUs: the kernel log covers it
                self.notes.append(f"GPU {index}: no Xid events from NVML ({exc})")
        if not self.registered:
            return
        self._thread = threading.Thread(target=self._loop, name="slurmft-nvml-xid", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout_ms / 1000 + 5)
            self._thread = None
        if self._event_set is not None:
            # The driver may already be gone; then there is nothing left to free.
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._nvml.nvmlEventSetWait_v2(self._event_set, self._timeout_ms)
            except self._nvml.NVMLError as exc:
                self._wait_failed(exc)
                continue
            if data.eventType & XID_CRITICAL_ERROR:
                self._on_event(int(data.eventData), self._index_of(data.device))

    def _wait_failed(self, exc: BaseException) -> None:
        code = error_code(exc)
        if code == NVML_ERROR_TIMEOUT:
            return
        if code == NVML_ERROR_GPU_IS_LOST:
            self._on_lost()
        else:
            log.warning("NVML event wait failed: %s", exc)
        # Not a timeout: wait before retrying so a broken driver does not spin a core.
        self._stop.wait(self._timeout_ms / 1000)

    def _index_of(self, device: Any) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetIndex(device))
        except self._nvml.NVMLError:
            return None
