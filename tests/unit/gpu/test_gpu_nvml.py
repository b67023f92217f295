"""The NVML source against a fake ``pynvml`` (tests/support/fake_nvml.py).

The fake raises the real ``pynvml.NVMLError`` classes with the recorded return codes (the
installed nvidia-ml-py, no driver needed), so the source is tested against the error values
NVML gives; tests/unit/gpu/test_nvml_contract.py holds the fake to the real pynvml.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pynvml
import pytest
from support.fake_nvml import FakeGpu, FakeNvml, nvml_error
from support.waiting import wait_for

from slurmft.gpu.api import FaultAction, FaultKind, SourceStatus
from slurmft.gpu.nvml import NvmlSource


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


@pytest.mark.serial  # bounds a wait in seconds
def test_xid_event_from_the_event_set_and_prompt_shutdown() -> None:
    fake = FakeNvml([FakeGpu(0), FakeGpu(1, bus="00000000:B3:00.0")])
    source = NvmlSource(fake, event_timeout_ms=20)
    source.start()
    assert fake.registered == [0, 1]
    fake.emit_xid(fake.gpus[1], 79)
    fake.emit_xid(fake.gpus[0], 13)
    wait_for(lambda: len(source.check().faults) == 2, 5, "both Xid faults", interval_s=0.01)
    faults = source.check().faults
    assert [(f.gpu, f.xid, f.action) for f in faults] == [
        (1, 79, FaultAction.DRAIN), (0, 13, FaultAction.RESTART_APP)]
    assert faults[0].drain_reason() == "slurmft: Xid 79 GPU fell off the bus (GPU 1)"
    assert faults[0].pci_bus == "0000:b3:00"
    # The loop keeps waiting through timeouts.
    wait_for(lambda: fake.waits > 3, 5, "more event waits", interval_s=0.01)
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
    wait_for(lambda: source.check().faults, 5, "the Xid fault", interval_s=0.01)
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
