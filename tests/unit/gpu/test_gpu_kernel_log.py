"""The kernel-log Xid parser on real-format lines, and the kernel-log source's reading modes.

Every fixture line is copied from a public report; the comment above it says where.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from slurmft.gpu.api import FaultAction, SourceStatus
from slurmft.gpu.kernel_log import (
    normalize_bus,
    parse_nvidia_smi_bus_map,
    parse_xid_lines,
    split_framing,
)
from slurmft.gpu.kmsg import KernelLogSource

# (line, xid, bus, pid, process, seconds since boot or None)
REAL_LINES = [
    # dmesg --ctime, driver 535 era: leptonai/gpud PR #46 (components/.../xid/README.md)
    (
        "[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', "
        "name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal "
        "Instruction Parameter",
        13, "0000:cb:00", "<unknown>", "<unknown>", None,
    ),
    # same source: pid and process name present
    (
        "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, "
        "name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
        109, "0000:cb:00", "1797828", "pt_main_thread", None,
    ),
    # plain dmesg, driver 535.129.01 on A800: vllm-project/vllm issue #5901
    (
        "[93297.027938] NVRM: Xid (PCI:0000:43:00): 13, pid='<unknown>', name=<unknown>, "
        "Graphics Exception: ESR 0x52e7b0=0x101000e 0x52e7b4=0x4 0x52e7a8=0xc81eb60 "
        "0x52e7ac=0x1174",
        13, "0000:43:00", "<unknown>", "<unknown>", 93297.027938,
    ),
    # syslog with the dmesg stamp inside, no pid/name (older driver): 3dem/relion issue #436
    (
        "Feb 15 17:37:45 Gipfeli kernel: [82659.755933] NVRM: Xid (PCI:0000:41:00): 13, "
        "Graphics SM Warp Exception on (GPC 1, TPC 0, SM 0): Illegal Instruction Encoding",
        13, "0000:41:00", None, None, 82659.755933,
    ),
    # dmesg, open module 595.71.05: NVIDIA/open-gpu-kernel-modules issue #1030
    (
        "[  365.969681] NVRM: Xid (PCI:0000:01:00): 31, pid=13705, name=UnrealEditor, channel "
        "0x0000000c, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC2 GPCCLIENT_PROP_0 faulted @ "
        "0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
        31, "0000:01:00", "13705", "UnrealEditor", 365.969681,
    ),
    # journalctl -k, driver 590.48.01: NVIDIA/open-gpu-kernel-modules issue #1150
    (
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 "
        "caused by previous Xid 149",
        45, "0000:dc:00", "1818990", "python3", None,
    ),
    # bare message: NVIDIA/NVSentinel issue #155 (comment)
    (
        "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus",
        79, "0000:44:00", None, None, None,
    ),
    # stas00/ml-engineering compute/accelerator/nvidia/debug.md
    (
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, "
        "reset gpu to activate.",
        63, "0000:10:1c", "1896", None, None,
    ),
    # old driver, no "PCI:" prefix, syslog: Ubuntu Forums "System crash with pixelation in
    # monitors" (2012)
    (
        "May 10 22:25:01 jambi kernel: [176830.774761] NVRM: Xid (0000:03:00): 13, 0003 "
        "00000000 00008297 00001098 00000000 00000044",
        13, "0000:03:00", None, None, 176830.774761,
    ),
    # NVLink5 Xid with subcode: leptonai/gpud PR #1160
    (
        "NVRM: Xid (PCI:0000:01:00): 144, SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 "
        "0x00000000 0x00000000 0x00000000 0x00000000)",
        144, "0000:01:00", None, None, None,
    ),
    # Xid 154 with the target action, driver 610.43.02 (a public Xid 79 crash write-up; the
    # text matches NVIDIA's catalog entry for Xid 154)
    (
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
        "(OS Reboot)",
        154, "0000:01:00", None, None, None,
    ),
    # /dev/kmsg record (Documentation/ABI/testing/dev-kmsg: "prio,seq,usec,flags;message"),
    # carrying the message of NVIDIA/open-gpu-kernel-modules issue #1030 above
    (
        "4,2093,365969681,-;NVRM: Xid (PCI:0000:01:00): 31, pid=13705, name=UnrealEditor, "
        "channel 0x0000000c, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC2",
        31, "0000:01:00", "13705", "UnrealEditor", 365.969681,
    ),
    # dmesg -r (raw: syslog priority before the stamp), the NVSentinel #155 message
    (
        "<4>[ 1843.308145] NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus",
        79, "0000:44:00", None, None, 1843.308145,
    ),
]


CASE_IDS = [f"{i}-xid{case[1]}" for i, case in enumerate(REAL_LINES)]


@pytest.mark.parametrize("case", REAL_LINES, ids=CASE_IDS)
def test_parser_reads_every_driver_format(case: tuple) -> None:
    line, xid, bus, pid, process, mono = case
    records = parse_xid_lines(line)
    assert len(records) == 1, line
    record = records[0]
    assert (record.xid, record.pci_bus, record.pid, record.process) == (xid, bus, pid, process)
    assert record.monotonic_s == (pytest.approx(mono) if mono is not None else None)
    assert not record.message.startswith(("pid=", "name=")), record.message


def test_message_keeps_the_driver_text_after_pid_and_name() -> None:
    (record,) = parse_xid_lines(REAL_LINES[1][0])
    assert record.message == "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005"


GARBAGE = [
    "",
    "   ",
    " SUBSYSTEM=pci",  # kmsg dictionary continuation line
    " DEVICE=+pci:0000:3b:00.0",
    "6,1,0,-;NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build",
    "Feb 14 05:03:41 gpu-1 kernel: mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE",
    # malformed Xid number (leptonai/gpud test table "Malformed XID - invalid number")
    "NVRM: Xid (PCI:0000:66:00): abc, pid=2280636",
    "[  365.969676] NVRM: GPU at PCI:0000:01:00: GPU-4e391288-897c-ba5d-6944-dfbea55ebcfa",
    "NVRM: Xid without a bus: 79",
    "\x00\x01\x02 binary junk \xff",
    "[not a stamp] NVRM: Xid",
]


def test_garbage_lines_are_ignored_not_errors() -> None:
    assert parse_xid_lines("\n".join(GARBAGE)) == []
    assert parse_xid_lines("\n".join([*GARBAGE, REAL_LINES[6][0], *GARBAGE]))[0].xid == 79


def test_three_line_fallen_off_the_bus_without_xid_is_xid_79() -> None:
    # Newer drivers, no Xid line: NVIDIA/NVSentinel issue #155 (dmesg); leptonai/gpud PR #1209
    text = (
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        "               NVRM: fallen off the bus and is not responding to commands.\n"
        "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).\n"
    )
    (record,) = parse_xid_lines(text)
    assert (record.xid, record.pci_bus) == (79, "0000:b3:00")
    assert record.monotonic_s == pytest.approx(1843.308145)


def test_fallen_off_the_bus_as_one_kmsg_record() -> None:
    # The same NVSentinel #155 message as /dev/kmsg gives it: one record whose newlines are
    # escaped as \x0a (Documentation/ABI/testing/dev-kmsg); dmesg prints those as the indented
    # continuation lines above.
    record = (
        "3,1500,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) "
        "installed in this system has\\x0aNVRM: fallen off the bus and is not responding to "
        "commands."
    )
    (found,) = parse_xid_lines(record)
    assert (found.xid, found.pci_bus, found.seq) == (79, "0000:b3:00", 1500)


def test_one_line_fallen_off_the_bus_is_xid_79() -> None:
    # driver 610.43.02 prints it after the Xid 79 line (the Xid 154 write-up above)
    (record,) = parse_xid_lines("NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.")
    assert (record.xid, record.pci_bus) == (79, "0000:01:00")


def test_kmsg_framing_gives_sequence_and_microseconds() -> None:
    kline = split_framing("4,2093,365969681,-;NVRM: hello")
    assert kline is not None
    assert (kline.seq, kline.monotonic_s, kline.message) == (2093, 365.969681, "NVRM: hello")
    assert split_framing(" SUBSYSTEM=pci") is None


def test_pci_bus_normalisation_and_nvidia_smi_map() -> None:
    assert normalize_bus("00000000:3B:00.0") == "0000:3b:00"
    assert normalize_bus("PCI:0000:3b:00".removeprefix("PCI:")) == "0000:3b:00"
    # nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader
    smi = "0, 00000000:18:00.0\n1, 00000000:3B:00.0\nNo devices were found\n"
    assert parse_nvidia_smi_bus_map(smi) == {"0000:18:00": 0, "0000:3b:00": 1}


# --- the source: /dev/kmsg, dmesg fallback, site file, unreadable -------------------------


def _kmsg_file(tmp_path: Path, records: list[str]) -> Path:
    path = tmp_path / "kmsg"
    path.write_text("".join(r + "\n" for r in records))
    return path


def test_kmsg_source_keeps_only_records_since_start_and_maps_bus_to_gpu(tmp_path: Path) -> None:
    path = _kmsg_file(tmp_path, [
        "4,10,1000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
        " SUBSYSTEM=pci",
        "4,11,5000000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=python, Graphics Exception",
        "4,12,5000100,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=python, Graphics Exception",
        "4,13,6000000,-;NVRM: Xid (PCI:0000:18:00): 48, pid=7, name=python, An uncorrectable",
    ])
    source = KernelLogSource(since_monotonic_s=2.0, kmsg_path=path,
                             bus_map=lambda: {"0000:3b:00": 3, "0000:18:00": 0})
    report = source.check()
    source.close()
    assert report.status is SourceStatus.OK
    # the Xid 79 from before the agent started is old news; the Xid 13 burst is one fault
    assert [(f.xid, f.gpu, f.action) for f in report.faults] == [
        (13, 3, FaultAction.RESTART_APP),
        (48, 0, FaultAction.DRAIN),
    ]
    assert report.faults[1].drain_reason() == "slurmft: Xid 48 double-bit ECC error (GPU 0)"
    assert report.faults[0].source == "kmsg"


def test_dmesg_fallback_when_kmsg_cannot_be_opened(tmp_path: Path) -> None:
    def fake_dmesg(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        out = "[    5.000000] NVRM: Xid (PCI:0000:3b:00): 95, pid=9, Uncontained error\n"
        return subprocess.CompletedProcess(argv, 0, out, "")

    source = KernelLogSource(since_monotonic_s=1.0, kmsg_path=tmp_path / "missing",
                             run=fake_dmesg)
    first, second = source.check(), source.check()
    assert first.reason == "reading dmesg"
    assert [f.xid for f in first.faults] == [95] == [f.xid for f in second.faults]


def test_unreadable_kernel_log_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    def refused(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(
            argv, 1, "", "dmesg: read kernel buffer failed: Operation not permitted")

    source = KernelLogSource(kmsg_path=tmp_path / "missing", run=refused)
    with caplog.at_level(logging.WARNING):
        reports = [source.check() for _ in range(3)]
    assert all(r.status is SourceStatus.UNAVAILABLE for r in reports)
    assert "dmesg_restrict" in reports[0].reason and "docs/gpu.md" in reports[0].reason
    assert len([r for r in caplog.records if "dmesg_restrict" in r.getMessage()]) == 1


def test_site_written_file_is_followed_as_it_grows(tmp_path: Path) -> None:
    path = tmp_path / "xids.log"
    source = KernelLogSource(file_path=path)
    assert source.check().faults == []  # not written yet: nothing, no error
    path.write_text("NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception\nNVRM: Xid (PCI:00")
    assert [f.xid for f in source.check().faults] == [13]  # the half line waits
    with path.open("a") as fh:
        fh.write("00:3b:00): 79, GPU has fallen off the bus.\n")
    report = source.check()
    assert [f.xid for f in report.faults] == [13, 79]
    assert report.faults[1].drain_reason() == "slurmft: Xid 79 GPU fell off the bus (0000:3b:00)"
