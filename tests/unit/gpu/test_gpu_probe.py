"""Fault injection, the DCGM parser, and the probe that merges sources."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from slurmft.gpu.api import FaultAction, FaultKind, SourceReport, SourceStatus
from slurmft.gpu.dcgm import DcgmSource, parse_dcgmi_health
from slurmft.gpu.inject import InjectionSource
from slurmft.gpu.probe import GpuProbe

# --- injection ------------------------------------------------------------------------------


def test_inline_injection_spec_goes_through_the_table() -> None:
    spec = "xid=79,gpu=3; xid=13,gpu=0 ;kind=ecc_uncorrected,gpu=1,count=2"
    report = InjectionSource(spec).check()
    assert report.status is SourceStatus.OK
    assert [(f.kind, f.gpu, f.xid, f.action) for f in report.faults] == [
        (FaultKind.XID, 3, 79, FaultAction.DRAIN),
        (FaultKind.XID, 0, 13, FaultAction.RESTART_APP),
        (FaultKind.ECC_UNCORRECTED, 1, None, FaultAction.DRAIN),
    ]
    assert report.faults[0].drain_reason() == "slurmft: Xid 79 GPU fell off the bus (GPU 3)"
    assert report.faults[0].source == "inject"


def test_injection_file_with_json_and_key_value_lines_grows(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    source = InjectionSource(str(path))
    assert source.check().faults == []  # no file yet: nothing injected, no error
    path.write_text(
        "# a drill\n"
        '{"xid": 154, "gpu": 2, "message": "GPU recovery action changed from 0x0 (None) to '
        '0x2 (Node Reboot Required)"}\n'
    )
    assert [f.summary for f in source.check().faults] == [
        "GPU recovery action: Node Reboot Required"]
    with path.open("a") as fh:
        fh.write("kind=remap_pending,gpu=0\nkind=gpu_lost,gpu=5\nkind=recovery_action,gpu=1,"
                 "value=1\nkind=clock_slowdown,gpu=4,reasons=thermal\nkind=remap_failure\n"
                 "kind=retired_pages_pending,gpu=6\n")
    kinds = [f.kind for f in source.check().faults]
    assert kinds == [FaultKind.XID, FaultKind.REMAP_PENDING, FaultKind.GPU_LOST,
                     FaultKind.RECOVERY_ACTION, FaultKind.CLOCK_SLOWDOWN, FaultKind.REMAP_FAILURE,
                     FaultKind.RETIRED_PAGES_PENDING]


def test_injection_lines_can_target_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = "xid=79,gpu=3,node=n2;xid=13,gpu=0;{\"xid\": 48, \"gpu\": 1, \"node\": \"n5\"}"
    assert [f.xid for f in InjectionSource(spec, node_name="n2").check().faults] == [79, 13]
    assert [f.xid for f in InjectionSource(spec, node_name="n5").check().faults] == [13, 48]
    monkeypatch.setenv("SLURMD_NODENAME", "n5")  # what Slurm sets in every job step
    assert [f.xid for f in InjectionSource(spec).check().faults] == [13, 48]


def test_bad_injection_lines_are_reported_with_their_line_number() -> None:
    report = InjectionSource("xid=79,gpu=3;kind=meteor,gpu=1;gpu;xid=lots").check()
    assert report.status is SourceStatus.UNAVAILABLE
    assert "line 2: unknown kind 'meteor'" in report.reason
    assert "line 3: expected key=value" in report.reason and "line 4:" in report.reason
    assert [f.xid for f in report.faults] == [79]  # the good line still counts


# --- DCGM -----------------------------------------------------------------------------------

# The JSON shape dcgmi writes (NVIDIA/DCGM dcgmi/Health.cpp builds it, DcgmiOutput.h stores
# values as "value" and long messages as 54-character "overflow" pieces), for the incidents
# of DCGM's own dcgmi/tests/HealthTests.cpp.
DCGMI_HEALTH_JSON = {
    "header": ["Health Monitor Report"],
    "body": {
        "Overall Health": {"value": "Failure"},
        "GPU": {"children": {
            "0": {"value": "Warning", "children": {"Errors": {"children": {
                "Memory system": {"value": "Warning", "overflow": [
                    "The car is red? Are you sure because that doesn't seem",
                    "like the color I ordered."]},
            }}}},
            "1": {"value": "Failure", "children": {"Errors": {"children": {
                "Memory system": {"value": "Failure", "overflow": [
                    "Green can be emerald and beautiful, but there are",
                    "shades of green which are sure to disappoint."]},
                "SM system": {"value": "Warning", "overflow": ["The guards wear Kholin blue"]},
            }}}},
        }},
    },
}


def test_dcgmi_health_json_becomes_faults() -> None:
    faults = parse_dcgmi_health(json.dumps(DCGMI_HEALTH_JSON))
    assert [(f.gpu, f.summary, f.action) for f in faults] == [
        (0, "DCGM Memory system warning", FaultAction.RECORD),
        (1, "DCGM Memory system failure", FaultAction.DRAIN),
        (1, "DCGM SM system warning", FaultAction.RECORD),
    ]
    assert faults[1].detail.startswith("Green can be emerald and beautiful, but there are shades")
    # healthy: the shape from NVIDIA/DCGM issue #263
    assert parse_dcgmi_health('{"body": {"Overall Health": {"value": "Healthy"}}, '
                              '"header": ["Health Monitor Report"]}') == []


def _runner(stdout: str, code: int = 0) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert argv == ["dcgmi", "health", "-c", "-j"]
        return subprocess.CompletedProcess(argv, code, stdout, "")
    return run


def test_dcgm_source_skips_absent_dcgm_and_unset_watches() -> None:
    assert DcgmSource(which=lambda _: None).check().status is SourceStatus.SKIPPED
    unset = DcgmSource(which=lambda _: "/usr/bin/dcgmi",
                       run=_runner("Error: Health watches not enabled. Please enable watches. \n",
                                   code=255)).check()
    assert unset.status is SourceStatus.SKIPPED and "dcgmi health -s a" in unset.reason
    broken = DcgmSource(which=lambda _: "/usr/bin/dcgmi",
                        run=_runner("Error: unable to establish a connection", code=255)).check()
    assert broken.status is SourceStatus.UNAVAILABLE
    ok = DcgmSource(which=lambda _: "/usr/bin/dcgmi",
                    run=_runner(json.dumps(DCGMI_HEALTH_JSON))).check()
    assert ok.status is SourceStatus.OK and len(ok.faults) == 3


# --- the probe ------------------------------------------------------------------------------


class ListSource:
    """A source whose faults the test controls."""

    name = "list"

    def __init__(self, spec: str = "") -> None:
        self.inner = InjectionSource(spec)
        self.started = self.closed = 0

    def start(self) -> None:
        self.started += 1

    def check(self) -> SourceReport:
        return self.inner.check()

    def close(self) -> None:
        self.closed += 1


def test_probe_merges_sources_and_hands_out_each_fault_once(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    path.write_text("xid=13,gpu=0\n")
    source = ListSource(str(path))
    with GpuProbe([source]) as probe:
        assert [f.xid for f in probe.new_faults()] == [13]
        assert probe.new_faults() == []
        with path.open("a") as fh:
            fh.write("xid=79,gpu=3\n")
        assert [f.xid for f in probe.new_faults()] == [79]
        report = probe.check()
        assert report.action is FaultAction.DRAIN
        assert report.drain_reason() == "slurmft: Xid 79 GPU fell off the bus (GPU 3)"
    assert (source.started, source.closed) == (1, 1)


def test_probe_watch_thread_streams_until_stopped(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    seen: list[int | None] = []
    got = threading.Event()
    probe = GpuProbe([ListSource(str(path))])
    stop = threading.Event()

    def on_fault(fault: object) -> None:
        seen.append(fault.xid)  # type: ignore[attr-defined]
        got.set()

    thread = probe.watch(on_fault, stop, interval_s=0.01)
    path.write_text("xid=48,gpu=1\n")
    assert got.wait(5)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and seen == [48]


def test_default_probe_on_this_machine_reports_no_gpu_and_nothing_fails(tmp_path: Path) -> None:
    probe = GpuProbe.default(kernel_log_file=tmp_path / "none", use_dcgm=False,
                             inject="kind=ecc_uncorrected,gpu=1")
    report = probe.check()
    probe.close()
    data = report.to_dict()
    if report.no_gpu:  # no NVIDIA driver here (the usual case on CI)
        assert data["gpu_present"] is False and "driver" in data["no_gpu_reason"]
    assert data["drain_reason"] == "slurmft: uncorrected ECC errors: 1 (GPU 1)"
    assert [s["source"] for s in data["sources"]] == ["nvml", "kernel_log", "inject"]


def test_importing_slurmft_gpu_loads_neither_pynvml_nor_torch() -> None:
    script = (
        "import sys, slurmft.gpu, slurmft.cli.gpu_cmd\n"
        "print(sorted(m for m in ('pynvml', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("spec", ["", "xid=79,gpu=3"])
def test_from_config_reads_the_gpu_settings(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmft.config import load_config

    config = load_config(environ={"SLURMFT_GPU_INJECT": spec, "SLURMFT_GPU_DCGM": "false"},
                         system_file=Path("/nonexistent"))
    probe = GpuProbe.from_config(config)
    names = [s.name for s in probe.sources]
    assert names == (["nvml", "kernel_log", "inject"] if spec else ["nvml", "kernel_log"])


def _every_source(tmp_path: Path) -> list[object]:
    from slurmft.gpu.kmsg import KernelLogSource
    from slurmft.gpu.nvml import NvmlSource

    return [
        NvmlSource(),  # the real pynvml: no driver here, or the GPUs where there are some
        KernelLogSource(file_path=tmp_path / "missing"),
        KernelLogSource(kmsg_path=tmp_path / "missing",
                        run=lambda argv, **_: subprocess.CompletedProcess(argv, 1, "", "denied")),
        DcgmSource(which=lambda _: None),
        InjectionSource("xid=79,gpu=3"),
    ]


def test_every_source_keeps_the_protocol_and_never_raises(tmp_path: Path) -> None:
    from slurmft.gpu.api import ProbeSource

    for source in _every_source(tmp_path):
        assert isinstance(source, ProbeSource), source
        source.start()
        first, again = source.check(), source.check()
        source.close()
        source.close()  # twice is fine
        assert isinstance(first, SourceReport) and first.source == source.name
        assert [f.identity() for f in first.faults] == [f.identity() for f in again.faults]
        json.dumps(first.to_dict())
