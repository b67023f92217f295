"""Parse NVIDIA driver (NVRM) Xid lines out of kernel-log text. Pure: no I/O here.

Accepted framings of one kernel message (the tests cite a public source for each):

- a ``/dev/kmsg`` record: ``4,1234,5678901234,-;NVRM: Xid ...`` (priority, sequence number,
  microseconds since boot, flags; continuation lines start with a space and are skipped);
- ``dmesg``: ``[ 1843.308145] NVRM: ...``; ``dmesg -T``: ``[Fri Aug 30 11:43:09 2024] NVRM: ...``;
  ``dmesg -r``: ``<4>[ 1843.308145] NVRM: ...``;
- syslog / ``journalctl -k``: ``Feb 15 17:37:45 host kernel: [82659.755847] NVRM: ...``;
- the bare message, as a site's root prolog may write it to a file.

Message shapes: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, <text>`` with
``pid='<unknown>'``/no pid/no name variants, the old ``NVRM: Xid (0000:03:00): 13, ...`` without
the ``PCI:`` prefix, and the Xid-less "GPU has fallen off the bus" messages (one line, or the
three-line form of newer drivers), which are reported as Xid 79.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_KMSG = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<msg>.*)$")
_DMESG_MONO = re.compile(r"^(?:<\d+>)?\[\s*(?P<sec>\d+\.\d+)\]\s?(?P<msg>.*)$")
_DMESG_CTIME = re.compile(r"^\[[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d [\d:]{8} \d{4}\]\s?(?P<msg>.*)$")
_SYSLOG = re.compile(r"^\S.*?\bkernel:\s(?P<msg>.*)$")

_BUS = r"(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?"
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?" + _BUS + r"\): (?P<xid>\d+),?\s*(?P<rest>.*)$")
_PID = re.compile(r"^pid=(?P<pid>'?<?[\w]+>?'?),\s*")
_NAME = re.compile(r"^name=(?P<name>[^,]*),\s*")
_FELL_ONE_LINE = re.compile(r"NVRM: GPU " + _BUS + r": GPU has fallen off the bus")
_FELL_WHOLE = re.compile(r"NVRM: The NVIDIA GPU " + _BUS + r"\s.*fallen off the bus")
_FELL_HEAD = re.compile(r"NVRM: The NVIDIA GPU " + _BUS + r"\s*$")
_FELL_TAIL = re.compile(r"NVRM: fallen off the bus and is not responding")


def normalize_bus(bus: str) -> str:
    """``0000:3B:00`` / ``00000000:3b:00.0`` -> ``0000:3b:00`` (domain, bus, device)."""
    domain, bus_no, device = bus.lower().split(".")[0].split(":")
    return f"{int(domain, 16):04x}:{bus_no}:{device}"


@dataclass(frozen=True)
class KernelLine:
    """One kernel message with its framing removed."""

    message: str
    monotonic_s: float | None = None  # seconds since boot, where the framing carries it
    seq: int | None = None  # /dev/kmsg sequence number


@dataclass(frozen=True)
class XidRecord:
    xid: int
    pci_bus: str  # normalised, see normalize_bus
    message: str  # the driver's text after the Xid number (pid/name removed)
    raw: str
    pid: str | None = None
    process: str | None = None
    monotonic_s: float | None = None
    seq: int | None = None


def split_framing(line: str) -> KernelLine | None:
    """Strip kmsg/dmesg/syslog framing; None for a kmsg continuation line or an empty one."""
    line = line.rstrip("\n")
    if not line.strip() or (line.startswith(" ") and "NVRM:" not in line):
        return None  # kmsg dictionary continuation (" SUBSYSTEM=pci") or blank
    if m := _KMSG.match(line):
        # kmsg escapes a multi-line message's newlines as \x0a (dmesg prints them as indented
        # lines instead): make it one line so the whole-message patterns see all of it.
        message = m["msg"].replace("\\x0a", " ")
        return KernelLine(message, int(m["usec"]) / 1e6, int(m["seq"]))
    if m := _SYSLOG.match(line):
        line = m["msg"]  # syslog may still carry a dmesg-style [seconds] stamp
    if m := _DMESG_MONO.match(line):
        return KernelLine(m["msg"].strip(), float(m["sec"]))
    if m := _DMESG_CTIME.match(line):
        return KernelLine(m["msg"].strip())
    return KernelLine(line.strip())


class XidParser:
    """Feed kernel-log lines one at a time; get an XidRecord for each Xid (or bus loss) seen.

    Stateful only for the three-line "The NVIDIA GPU <bus> ... fallen off the bus" message.
    Anything that is not an NVRM Xid line is ignored, never an error.
    """

    def __init__(self) -> None:
        self._fell: tuple[str, KernelLine] | None = None  # bus and head line of the 3-liner

    def feed(self, line: str) -> XidRecord | None:
        kline = split_framing(line)
        if kline is None:
            return None
        msg = kline.message
        if m := _XID.search(msg):
            return _xid_record(m, line, kline)
        if m := _FELL_ONE_LINE.search(msg) or _FELL_WHOLE.search(msg):
            return _bus_loss(m["bus"], line, kline)
        if m := _FELL_HEAD.search(msg):
            self._fell = (m["bus"], kline)
            return None
        if self._fell is not None and _FELL_TAIL.search(msg):
            (bus, head), self._fell = self._fell, None
            return _bus_loss(bus, line, head)  # the head line carries the timestamp
        return None

    def feed_text(self, text: str) -> list[XidRecord]:
        return [r for line in text.splitlines() if (r := self.feed(line)) is not None]


def parse_xid_lines(text: str) -> list[XidRecord]:
    """Every Xid in a block of kernel-log text, in order."""
    return XidParser().feed_text(text)


def _xid_record(m: re.Match[str], raw: str, kline: KernelLine) -> XidRecord:
    rest, pid, process = m["rest"], None, None
    if pm := _PID.match(rest):
        pid, rest = pm["pid"].strip("'"), rest[pm.end() :]
    if nm := _NAME.match(rest):
        process, rest = nm["name"], rest[nm.end() :]
    return XidRecord(
        xid=int(m["xid"]),
        pci_bus=normalize_bus(m["bus"]),
        message=rest.strip(),
        raw=raw.strip(),
        pid=pid,
        process=process,
        monotonic_s=kline.monotonic_s,
        seq=kline.seq,
    )


def _bus_loss(bus: str, raw: str, kline: KernelLine) -> XidRecord:
    return XidRecord(
        xid=79,
        pci_bus=normalize_bus(bus),
        message="GPU has fallen off the bus (no Xid line)",
        raw=raw.strip(),
        monotonic_s=kline.monotonic_s,
        seq=kline.seq,
    )


def parse_nvidia_smi_bus_map(text: str) -> dict[str, int]:
    """PCI bus -> GPU index from ``nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader``.

    Lines look like ``0, 00000000:3B:00.0``; anything else is skipped.
    """
    mapping: dict[str, int] = {}
    for line in text.splitlines():
        index, _, bus = (part.strip() for part in line.partition(","))
        if index.isdigit() and bus.count(":") == 2:
            try:
                mapping[normalize_bus(bus)] = int(index)
            except ValueError:
                continue
    return mapping
