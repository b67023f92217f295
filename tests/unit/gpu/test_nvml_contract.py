"""The NVML seam as the source (slurmft.gpu.nvml) relies on it: the same assertions against the
fake NVML (tests/support/fake_nvml.py, fed with the recording of pynvml's codes, constants and
structs) and against the real pynvml on a machine with an NVIDIA GPU.

The real half is marked `gpu`: it skips, with the reason, where no driver is (CI), and the
fake half always runs. The recording itself is held to the installed pynvml here too, and the
source's own copies of NVML's numbers to the recording.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest
from support.fake_nvml import CONSTANTS, RECORDING, STRUCTS, FakeGpu, FakeNvml, code

from slurmft.gpu import nvml as source_module
from slurmft.gpu import nvml_events
from slurmft.gpu.api import FaultKind, SourceStatus
from slurmft.gpu.kernel_log import normalize_bus
from slurmft.gpu.nvml import NvmlSource
from slurmft.gpu.nvml_events import error_code

# What a field the source reads may fail with, and the source still checks the rest: skipped
# (not supported here, or a function the driver predates), or the GPU is gone.
FIELD_ERRORS = {code("NOT_SUPPORTED"), code("FUNCTION_NOT_FOUND"), code("GPU_IS_LOST")}
RECOVERY_ACTIONS = {v for k, v in CONSTANTS.items() if k.startswith("NVML_GPU_RECOVERY_ACTION_")}


def contract_gpus() -> list[FakeGpu]:
    """A healthy GPU, one that supports none of the fields, a faulty one, one whose driver
    predates the recovery field, and one that fell off the bus after it was opened."""
    return [
        FakeGpu(0, "00000000:18:00.0"),
        FakeGpu(1, unsupported={"ecc", "rows", "pages", "fields", "clocks", "events"}),
        FakeGpu(2, "00000000:B3:00.0", ecc_uncorrected=2, rows=(5, 1, 1, 0), pages_pending=1,
                recovery=CONSTANTS["NVML_GPU_RECOVERY_ACTION_NODE_REBOOT"],
                clocks=CONSTANTS["nvmlClocksEventReasonHwThermalSlowdown"]),
        FakeGpu(3, recovery=2, recovery_return=code("NOT_SUPPORTED")),
        FakeGpu(4, lost=True),
    ]  # fmt: skip


@pytest.fixture(params=["fake", pytest.param("driver", marks=pytest.mark.gpu)])
def nvml(request: pytest.FixtureRequest) -> Any:
    """The fake over contract_gpus(), or the installed pynvml over this machine's GPUs."""
    return FakeNvml(contract_gpus()) if request.param == "fake" else pynvml


@contextlib.contextmanager
def started(nvml: Any) -> Iterator[list[Any]]:
    """NVML initialised, and a handle of every GPU; shut down again after."""
    nvml.nvmlInit()
    try:
        yield [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    finally:
        nvml.nvmlShutdown()


def answer(call: Any, *args: Any) -> tuple[Any, int | None]:
    """What an NVML call gives: (value, None), or (None, the return code it raised)."""
    try:
        return call(*args), None
    except pynvml.NVMLError as error:
        return None, error_code(error)


def raised(nvml: Any, call: Any, *args: Any) -> int | None:
    with pytest.raises(nvml.NVMLError) as info:
        call(*args)
    return error_code(info.value)


def test_a_call_before_nvml_init_is_uninitialized(nvml: Any) -> None:
    assert raised(nvml, nvml.nvmlDeviceGetCount) == code("UNINITIALIZED")


def test_an_index_past_the_last_gpu_is_an_invalid_argument(nvml: Any) -> None:
    with started(nvml) as handles:
        assert handles, "no GPU"
        past = raised(nvml, nvml.nvmlDeviceGetHandleByIndex, len(handles))
    assert past == code("INVALID_ARGUMENT")


def test_every_gpu_names_itself_and_its_bus(nvml: Any) -> None:
    with started(nvml) as handles:
        for index, handle in enumerate(handles):
            found, error = answer(nvml.nvmlDeviceGetIndex, handle)
            assert error in FIELD_ERRORS if error else found == index
            name, error = answer(nvml.nvmlDeviceGetName, handle)
            assert error in FIELD_ERRORS if error else isinstance(name, str) and name
            pci, error = answer(nvml.nvmlDeviceGetPciInfo, handle)
            if error is None:
                assert isinstance(pci.busId, bytes)
                assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}", normalize_bus(
                    pci.busId.decode()))  # fmt: skip
            else:
                assert error in FIELD_ERRORS


def test_every_field_the_source_reads_has_its_shape_or_a_code_it_handles(nvml: Any) -> None:
    ecc = (CONSTANTS["NVML_MEMORY_ERROR_TYPE_UNCORRECTED"], CONSTANTS["NVML_VOLATILE_ECC"])
    recovery_field = CONSTANTS["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"]
    with started(nvml) as handles:
        for handle in handles:
            _check(answer(nvml.nvmlDeviceGetTotalEccErrors, handle, *ecc), _count)
            _check(answer(nvml.nvmlDeviceGetRemappedRows, handle), _four_counts)
            _check(answer(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle), _flag)
            _check(answer(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle), _count)
            values = answer(nvml.nvmlDeviceGetFieldValues, handle, [recovery_field])
            _check(values, lambda v: _recovery_action(v, recovery_field))


def _check(answered: tuple[Any, int | None], shape: Any) -> None:
    value, error = answered
    if error is not None:
        assert error in FIELD_ERRORS, f"NVML return code {error}"
    else:
        shape(value)


def _count(value: Any) -> None:
    assert isinstance(value, int) and value >= 0, value


def _flag(value: Any) -> None:
    assert value in (0, 1), value


def _four_counts(value: Any) -> None:
    assert len(value) == 4, value
    for count in value:
        _count(count)


def _recovery_action(values: Any, field_id: int) -> None:
    (value,) = values
    assert value.fieldId == field_id and isinstance(value.nvmlReturn, int)
    if value.nvmlReturn == CONSTANTS["NVML_SUCCESS"]:
        assert value.value.uiVal in RECOVERY_ACTIONS
    else:
        assert value.nvmlReturn in FIELD_ERRORS


def test_an_event_wait_without_an_xid_times_out(nvml: Any) -> None:
    with started(nvml) as handles:
        event_set = nvml.nvmlEventSetCreate()
        try:
            kind = CONSTANTS["nvmlEventTypeXidCriticalError"]
            register = nvml.nvmlDeviceRegisterEvents
            registered = [answer(register, handle, kind, event_set) for handle in handles]
            assert all(error in (None, *FIELD_ERRORS) for _, error in registered)
            if any(error is None for _, error in registered):
                assert raised(nvml, nvml.nvmlEventSetWait_v2, event_set, 1) == code("TIMEOUT")
        finally:
            nvml.nvmlEventSetFree(event_set)


def test_the_source_reads_every_gpu(nvml: Any) -> None:
    with started(nvml) as handles:
        count = len(handles)
    source = NvmlSource(nvml, event_timeout_ms=20)
    try:
        report = source.check()
    finally:
        source.close()
    assert report.status is SourceStatus.OK, report.reason
    assert len(report.gpus) == count
    assert all(isinstance(f.kind, FaultKind) and f.source == "nvml" for f in report.faults)
    assert set(source.bus_map().values()) <= set(range(count))


# --- the recording and the fake against pynvml, the source against the recording -------------


def test_the_recording_is_what_the_installed_pynvml_defines() -> None:
    for name, recorded in RECORDING["errors"].items():
        error = pynvml.NVMLError(getattr(pynvml, name))
        assert (error.value, type(error).__name__, str(error)) == (
            recorded["code"], recorded["class"], recorded["message"]), name  # fmt: skip
    for name, value in CONSTANTS.items():
        assert getattr(pynvml, name) == value, name
    for struct, fields in STRUCTS.items():
        assert set(fields) <= {f[0] for f in getattr(pynvml, struct)._fields_}, struct


def test_the_fakes_answers_carry_the_fields_of_nvmls_structs() -> None:
    fake = FakeNvml([FakeGpu(0)])
    with started(fake) as (handle,):
        (value,) = fake.nvmlDeviceGetFieldValues(handle, [fake.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
        pci = fake.nvmlDeviceGetPciInfo(handle)
        fake.emit_xid(handle, 79)
        event = fake.events.get_nowait()
    assert list(vars(value)) == STRUCTS["c_nvmlFieldValue_t"]
    assert list(vars(value.value)) == STRUCTS["c_nvmlValue_t"]
    assert list(vars(pci)) == STRUCTS["nvmlPciInfo_t"]
    assert list(vars(event)) == STRUCTS["c_nvmlEventData_t"]


def test_the_sources_own_nvml_numbers_are_the_recorded_ones() -> None:
    own_codes = {
        "NOT_SUPPORTED": nvml_events.NVML_ERROR_NOT_SUPPORTED,
        "TIMEOUT": nvml_events.NVML_ERROR_TIMEOUT,
        "FUNCTION_NOT_FOUND": nvml_events.NVML_ERROR_FUNCTION_NOT_FOUND,
        "GPU_IS_LOST": nvml_events.NVML_ERROR_GPU_IS_LOST,
        "DRIVER_NOT_LOADED": source_module.NVML_ERROR_DRIVER_NOT_LOADED,
        "LIBRARY_NOT_FOUND": source_module.NVML_ERROR_LIBRARY_NOT_FOUND,
    }
    assert own_codes == {name: code(name) for name in own_codes}
    own_constants = {
        "NVML_SUCCESS": nvml_events.NVML_SUCCESS,
        "nvmlEventTypeXidCriticalError": nvml_events.XID_CRITICAL_ERROR,
    }
    assert own_constants == {name: CONSTANTS[name] for name in own_constants}
    # The clock event reasons that mean a slowdown (idle and clock settings are normal).
    slowdowns = ["SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown",
                 "HwPowerBrakeSlowdown"]  # fmt: skip
    recorded = {CONSTANTS[f"nvmlClocksEventReason{name}"] for name in slowdowns}
    assert set(source_module.SLOWDOWN_REASONS) == recorded
