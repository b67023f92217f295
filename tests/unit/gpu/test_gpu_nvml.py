"""The NVML source against a fake ``pynvml``.

The fake raises the real ``pynvml.NVMLError`` classes with the real return codes (the installed
nvidia-ml-py, no driver needed), so the source is tested against the error values NVML gives.
"""

from __future__ import annotations

import queue
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from slurmft.gpu.api import FaultAction, FaultKind, SourceStatus
from slurmft.gpu.nvml import NvmlSource


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


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
    """The subset of pynvml the source calls, over a list of FakeGpu."""

    NVMLError = pynvml.NVMLError
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: list[int] = []
        self.waits = 0
        self.shutdown = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise nvml_error(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        if gpu.handle_error is not None:
            raise nvml_error(gpu.handle_error)
        return gpu

    def _get(self, gpu: FakeGpu, name: str, value: Any) -> Any:
        if gpu.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if name in gpu.unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(busId=self._get(gpu, "pci", gpu.bus.encode()))

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return self._get(gpu, "name", gpu.name)

    def nvmlDeviceGetIndex(self, gpu: FakeGpu) -> int:
        return gpu.index

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (1, 0)  # uncorrected, volatile
        return self._get(gpu, "ecc", gpu.ecc_uncorrected)

    def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
        return self._get(gpu, "rows", gpu.rows)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: FakeGpu) -> int:
        return self._get(gpu, "pages", gpu.pages_pending)

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[int]) -> list[Any]:
        assert field_ids == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        self._get(gpu, "fields", None)
        return [SimpleNamespace(fieldId=field_ids[0], nvmlReturn=gpu.recovery_return,
                                value=SimpleNamespace(uiVal=gpu.recovery))]

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        return self._get(gpu, "clocks", gpu.clocks)

    # events
    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, kinds: int, event_set: object) -> None:
        assert kinds == pynvml.nvmlEventTypeXidCriticalError
        self._get(gpu, "events", None)
        self.registered.append(gpu.index)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        self.waits += 1
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass

    def emit_xid(self, gpu: FakeGpu, xid: int) -> None:
        self.events.put(SimpleNamespace(device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError,
                                        eventData=xid))


def check(fake: FakeNvml) -> Any:
    source = NvmlSource(fake, event_timeout_ms=20)
    try:
        return source.check()
    finally:
        source.close()


def test_healthy_gpus_report_no_faults_and_their_bus() -> None:
    fake = FakeNvml([FakeGpu(0, "00000000:18:00.0"), FakeGpu(1)])
    source = NvmlSource(fake, event_timeout_ms=20)
    report = source.check()
    assert report.status is SourceStatus.OK and report.faults == []
    assert report.gpus == ["0: NVIDIA H100 80GB HBM3 (0000:18:00)",
                           "1: NVIDIA H100 80GB HBM3 (0000:3b:00)"]
    assert source.bus_map() == {"0000:18:00": 0, "0000:3b:00": 1}
    source.close()
    assert fake.shutdown


@pytest.mark.parametrize(("code", "status", "why"), [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, SourceStatus.NO_GPU, "no NVIDIA driver"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, SourceStatus.NO_GPU, "driver is not loaded"),
    (pynvml.NVML_ERROR_NO_PERMISSION, SourceStatus.UNAVAILABLE, "Insufficient Permissions"),
])
def test_no_driver_is_no_gpu_not_a_failure(code: int, status: SourceStatus, why: str) -> None:
    report = check(FakeNvml([FakeGpu(0)], init_error=code))
    assert report.status is status and why in report.reason and report.faults == []


def test_no_gpus_at_all() -> None:
    assert check(FakeNvml([])).status is SourceStatus.NO_GPU


def test_the_real_pynvml_on_a_machine_without_the_driver(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The installed pynvml, imported lazily, on this driverless machine: "no GPU"."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    report = NvmlSource().check()
    assert report.status is SourceStatus.NO_GPU
    assert report.reason == "no NVIDIA driver on this node (libnvidia-ml.so.1 not found)"


def test_pynvml_comes_from_sys_modules_when_not_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([FakeGpu(0, ecc_uncorrected=1)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    source = NvmlSource(event_timeout_ms=20)
    report = source.check()
    source.close()
    assert [f.kind for f in report.faults] == [FaultKind.ECC_UNCORRECTED]


def test_not_supported_is_skipped_field_by_field() -> None:
    every = {"ecc", "rows", "pages", "fields", "clocks", "events", "pci", "name"}
    quiet = FakeGpu(0, unsupported=every)
    # GPU 1 lacks only ECC and rows; its pending pages and recovery action still count
    partial = FakeGpu(1, unsupported={"ecc", "rows"}, pages_pending=1, recovery=2)
    report = check(FakeNvml([quiet, partial]))
    assert report.status is SourceStatus.OK
    assert [(f.gpu, f.kind) for f in report.faults] == [
        (1, FaultKind.RETIRED_PAGES_PENDING),
        (1, FaultKind.RECOVERY_ACTION),
    ]
    assert report.gpus[0] == "0: NVIDIA GPU (?)"
    assert "GPU 0: no Xid events from NVML (Not Supported)" in report.reason
    assert "nvmlDevice" not in report.reason  # NotSupported fields are skipped silently


def test_an_unexpected_field_error_is_noted_and_the_rest_still_checked() -> None:
    class Flaky(FakeNvml):
        def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
            raise nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    report = check(Flaky([FakeGpu(0, ecc_uncorrected=1)]))
    assert [f.kind for f in report.faults] == [FaultKind.ECC_UNCORRECTED]
    assert report.reason == "GPU 0: nvmlDeviceGetRemappedRows: Unknown Error"


def test_each_condition_and_its_action() -> None:
    gpus = [
        FakeGpu(0, ecc_uncorrected=2),
        FakeGpu(1, rows=(5, 1, 1, 0)),
        FakeGpu(2, rows=(0, 0, 0, 1)),
        FakeGpu(3, recovery=pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT),
        FakeGpu(4, clocks=pynvml.nvmlClocksEventReasonHwThermalSlowdown
                | pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonGpuIdle),
        FakeGpu(5, clocks=pynvml.nvmlClocksEventReasonGpuIdle
                | pynvml.nvmlClocksEventReasonApplicationsClocksSetting),
    ]
    faults = check(FakeNvml(gpus)).faults
    assert [(f.gpu, f.kind, f.action, f.drain_reason()) for f in faults] == [
        (0, FaultKind.ECC_UNCORRECTED, FaultAction.DRAIN,
         "slurmft: uncorrected ECC errors: 2 (GPU 0)"),
        (1, FaultKind.REMAP_PENDING, FaultAction.DRAIN,
         "slurmft: row remap pending (GPU reset needed) (GPU 1)"),
        (2, FaultKind.REMAP_FAILURE, FaultAction.DRAIN, "slurmft: row remap failure (GPU 2)"),
        (3, FaultKind.RECOVERY_ACTION, FaultAction.DRAIN,
         "slurmft: GPU recovery action Node Reboot (GPU 3)"),
        (4, FaultKind.CLOCK_SLOWDOWN, FaultAction.RECORD,
         "slurmft: clocks slowed: power cap, thermal slowdown (hardware) (GPU 4)"),
    ]


def test_recovery_action_absent_from_driver_or_pynvml() -> None:
    old_driver = FakeGpu(0, recovery=2, recovery_return=pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert check(FakeNvml([old_driver])).faults == []

    class OldPynvml(FakeNvml):
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = None  # the constant does not exist there

    assert check(OldPynvml([FakeGpu(0, recovery=2)])).faults == []


def test_gpu_lost_on_any_field_or_on_open() -> None:
    fake = FakeNvml([FakeGpu(0), FakeGpu(1),
                     FakeGpu(2, handle_error=pynvml.NVML_ERROR_GPU_IS_LOST),
                     FakeGpu(3, handle_error=pynvml.NVML_ERROR_UNKNOWN)])
    source = NvmlSource(fake, event_timeout_ms=20)
    source.start()
    fake.gpus[1].lost = True  # falls off the bus after start
    faults = source.check().faults
    source.close()
    by_gpu = {f.gpu: f for f in faults}
    assert by_gpu[1].kind is FaultKind.GPU_LOST and by_gpu[1].action is FaultAction.DRAIN
    assert by_gpu[1].drain_reason() == "slurmft: GPU is lost (GPU 1)"
    assert by_gpu[2].kind is FaultKind.GPU_LOST and by_gpu[2].action is FaultAction.DRAIN
    # an unknown error opening a GPU is shown to a human, not a drain on its own
    assert by_gpu[3].action is FaultAction.RECORD
    assert 0 not in by_gpu


def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.serial  # bounds a wait in seconds
def test_xid_event_from_the_event_set_and_prompt_shutdown() -> None:
    fake = FakeNvml([FakeGpu(0), FakeGpu(1, bus="00000000:B3:00.0")])
    source = NvmlSource(fake, event_timeout_ms=20)
    source.start()
    assert fake.registered == [0, 1]
    fake.emit_xid(fake.gpus[1], 79)
    fake.emit_xid(fake.gpus[0], 13)
    _wait_for(lambda: len(source.check().faults) == 2)
    faults = source.check().faults
    assert [(f.gpu, f.xid, f.action) for f in faults] == [
        (1, 79, FaultAction.DRAIN), (0, 13, FaultAction.RESTART_APP)]
    assert faults[0].drain_reason() == "slurmft: Xid 79 GPU fell off the bus (GPU 1)"
    assert faults[0].pci_bus == "0000:b3:00"
    _wait_for(lambda: fake.waits > 3)  # the loop keeps waiting through timeouts
    started = time.monotonic()
    source.close()
    assert time.monotonic() - started < 2.0  # short waits: shutdown does not hang


def test_events_not_supported_leave_the_counters_working() -> None:
    fake = FakeNvml([FakeGpu(0, unsupported={"events"}, ecc_uncorrected=1)])
    source = NvmlSource(fake, event_timeout_ms=20)
    report = source.check()
    source.close()
    assert fake.registered == [] and fake.waits == 0
    assert [f.kind for f in report.faults] == [FaultKind.ECC_UNCORRECTED]


def test_unknown_xid_event_restarts_the_app() -> None:
    fake = FakeNvml([FakeGpu(0)])
    source = NvmlSource(fake, event_timeout_ms=20)
    source.start()
    fake.emit_xid(fake.gpus[0], 999)  # NVML: "999 for unknown xid error"
    _wait_for(lambda: bool(source.check().faults))
    (fault,) = source.check().faults
    source.close()
    assert (fault.xid, fault.action, fault.summary) == (999, FaultAction.RESTART_APP, "unknown Xid")


def test_pynvml_that_cannot_be_imported_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    report = NvmlSource().check()
    assert report.status is SourceStatus.SKIPPED
    assert report.reason.startswith("cannot import pynvml (package nvidia-ml-py)")


def test_probe_maps_kernel_log_buses_to_nvml_indices(tmp_path: Any) -> None:
    from slurmft.gpu.probe import GpuProbe

    log = tmp_path / "kernel-nvrm.log"
    log.write_text("NVRM: Xid (PCI:0000:b3:00): 79, pid=9, GPU has fallen off the bus.\n")
    fake = FakeNvml([FakeGpu(0, "00000000:18:00.0"), FakeGpu(1, "00000000:B3:00.0")])
    with GpuProbe.default(nvml=fake, kernel_log_file=log, use_dcgm=False) as probe:
        report = probe.check()
    assert not report.no_gpu and report.gpu_count == 2
    assert report.drain_reason() == "slurmft: Xid 79 GPU fell off the bus (GPU 1)"
