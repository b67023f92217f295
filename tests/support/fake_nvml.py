"""The subset of pynvml that the NVML source (slurmft.gpu.nvml) calls, over fake GPUs.

Fed with the recording of what NVML says (tests/fixtures/nvml/pynvml-<version>.json, made by
tests/fixtures/nvml/record.py from the installed nvidia-ml-py): the return codes it raises are
the recorded ones, raised as pynvml's own NVMLError classes (so the source meets the exception
types and messages a driver gives); the ECC counter, field id and event type it expects are the
recorded constants; the values it answers carry exactly the fields of NVML's structs.

tests/unit/gpu/test_nvml_contract.py runs the same assertions against this fake and against
the real pynvml on a machine with a GPU.
"""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

RECORDED_VERSION = "13.615.71"
RECORDING_FILE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / f"pynvml-{RECORDED_VERSION}.json"
)
RECORDING: dict[str, Any] = json.loads(RECORDING_FILE.read_text())
CONSTANTS: dict[str, int] = RECORDING["constants"]
STRUCTS: dict[str, list[str]] = RECORDING["structs"]


def code(name: str) -> int:
    """The recorded return code: ``code("GPU_IS_LOST")`` is NVML_ERROR_GPU_IS_LOST's."""
    return int(RECORDING["errors"][f"NVML_ERROR_{name}"]["code"])


def nvml_error(error_code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(error_code)


def record(struct: str, **values: Any) -> SimpleNamespace:
    """An answer shaped as NVML's ``struct``: every recorded field, zero unless given."""
    unknown = set(values) - set(STRUCTS[struct])
    assert not unknown, f"{struct} has no field {unknown}"
    return SimpleNamespace(**{name: values.get(name, 0) for name in STRUCTS[struct]})


@dataclass
class FakeGpu:
    index: int
    bus: str = "00000000:3B:00.0"
    name: str = "NVIDIA H100 80GB HBM3"
    ecc_uncorrected: int = 0
    rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    pages_pending: int = 0
    recovery: int = 0
    recovery_return: int = 0  # nvmlReturn inside the field value struct
    clocks: int = 0
    lost: bool = False
    handle_error: int | None = None
    unsupported: set[str] = field(default_factory=set)


class FakeNvml:
    """pynvml's calls over a list of FakeGpu, with NVML's rules: nothing but nvmlInit works
    before it (or after the last nvmlShutdown), an index past the last GPU is an invalid
    argument, a lost GPU fails every call on it."""

    NVMLError = pynvml.NVMLError
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = CONSTANTS["NVML_MEMORY_ERROR_TYPE_UNCORRECTED"]
    NVML_VOLATILE_ECC = CONSTANTS["NVML_VOLATILE_ECC"]
    nvmlEventTypeXidCriticalError = CONSTANTS["nvmlEventTypeXidCriticalError"]
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = CONSTANTS["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"]

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: list[int] = []
        self.waits = 0
        self.initialised = 0  # pynvml counts nvmlInit calls; the last nvmlShutdown ends it
        self.shutdown = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._started()
        self.initialised -= 1
        self.shutdown = self.initialised == 0

    def _started(self) -> None:
        if not self.initialised:
            raise nvml_error(code("UNINITIALIZED"))

    def nvmlDeviceGetCount(self) -> int:
        self._started()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._started()
        if not 0 <= index < len(self.gpus):
            raise nvml_error(code("INVALID_ARGUMENT"))
        gpu = self.gpus[index]
        if gpu.handle_error is not None:
            raise nvml_error(gpu.handle_error)
        return gpu

    def _get(self, gpu: FakeGpu, name: str, value: Any) -> Any:
        self._started()
        if gpu.lost:
            raise nvml_error(code("GPU_IS_LOST"))
        if name in gpu.unsupported:
            raise nvml_error(code("NOT_SUPPORTED"))
        return value

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> Any:
        return record("nvmlPciInfo_t", busId=self._get(gpu, "pci", gpu.bus.encode()))

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return self._get(gpu, "name", gpu.name)

    def nvmlDeviceGetIndex(self, gpu: FakeGpu) -> int:
        return self._get(gpu, "index", gpu.index)

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                         self.NVML_VOLATILE_ECC)  # fmt: skip
        return self._get(gpu, "ecc", gpu.ecc_uncorrected)

    def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
        return self._get(gpu, "rows", gpu.rows)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: FakeGpu) -> int:
        return self._get(gpu, "pages", gpu.pages_pending)

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[int]) -> list[Any]:
        assert field_ids == [self.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        self._get(gpu, "fields", None)
        value = record("c_nvmlValue_t", uiVal=gpu.recovery)
        return [record("c_nvmlFieldValue_t", fieldId=field_ids[0],
                       nvmlReturn=gpu.recovery_return, value=value)]  # fmt: skip

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        return self._get(gpu, "clocks", gpu.clocks)

    # events
    def nvmlEventSetCreate(self) -> object:
        self._started()
        return object()

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, kinds: int, event_set: object) -> None:
        assert kinds == self.nvmlEventTypeXidCriticalError
        self._get(gpu, "events", None)
        self.registered.append(gpu.index)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        self._started()
        self.waits += 1
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise nvml_error(code("TIMEOUT")) from None

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._started()

    def emit_xid(self, gpu: FakeGpu, xid: int) -> None:
        """An Xid critical error on ``gpu``, as nvmlEventSetWait_v2 hands it out."""
        event = record("c_nvmlEventData_t", device=gpu,
                       eventType=self.nvmlEventTypeXidCriticalError, eventData=xid)  # fmt: skip
        self.events.put(event)
