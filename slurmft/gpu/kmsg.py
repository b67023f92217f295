"""The kernel-log source: Xid lines from the ring buffer since the agent started.

Only the ring buffer (``/dev/kmsg``, or ``dmesg`` where that cannot be opened), never old
syslog: grepping syslog kept nodes drained until logrotate at one site. ``/dev/kmsg`` gives
each record a sequence number and a monotonic timestamp, so "since the agent started" is exact.

Where users may not read the kernel log (``kernel.dmesg_restrict=1``) the source says so once
(a warning, and UNAVAILABLE with the fix in its reason) and the probe carries on with NVML.
A site can grant it without privileges for the job: a root prolog or Slurm's
HealthCheckProgram appends what it sees to a file, and ``gpu.kernel_log_file`` points here.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from slurmft.gpu.api import FaultKind, GpuFault, SourceReport, SourceStatus
from slurmft.gpu.kernel_log import XidParser, XidRecord
from slurmft.gpu.xids import classify_xid

log = logging.getLogger(__name__)

UNREADABLE_HINT = (
    "the kernel log is not readable by this user (kernel.dmesg_restrict=1?); GPU Xids come "
    "from NVML only. To grant it, see docs/gpu.md (root prolog or HealthCheckProgram writing "
    "to gpu.kernel_log_file)"
)

BusMap = Callable[[], Mapping[str, int]]
Runner = Callable[..., subprocess.CompletedProcess[str]]


def monotonic_now() -> float:
    """Seconds since boot on the clock the kernel log stamps its records with."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def xid_fault(record: XidRecord, source: str, gpu: int | None, key: str) -> GpuFault:
    verdict = classify_xid(record.xid, record.message)
    return GpuFault(
        kind=FaultKind.XID,
        action=verdict.action,
        summary=verdict.summary,
        source=source,
        gpu=gpu,
        xid=record.xid,
        pci_bus=record.pci_bus,
        detail=record.raw,
        fault_class=verdict.fault_class,
        key=key,
        monotonic_s=record.monotonic_s,
    )


class KernelLogSource:
    """Xids from ``/dev/kmsg`` (preferred), ``dmesg`` (fallback) or a site-written file."""

    name = "kernel_log"

    def __init__(
        self,
        *,
        since_monotonic_s: float | None = None,
        kmsg_path: Path = Path("/dev/kmsg"),
        file_path: Path | None = None,
        bus_map: BusMap | None = None,
        run: Runner = subprocess.run,
    ) -> None:
        # None: from now on. The agent passes its own start time so preflight sees the gap.
        self._since = monotonic_now() if since_monotonic_s is None else since_monotonic_s
        self._kmsg_path = kmsg_path
        self._file_path = file_path
        self._bus_map = bus_map or dict
        self._run = run
        self._parser = XidParser()
        self._faults: dict[str, GpuFault] = {}
        self._fd: int | None = None
        self._file_offset = 0
        self._mode: str | None = None  # "kmsg", "dmesg", "file", or None: unreadable
        self._reason = ""
        self._warned = False

    def start(self) -> None:
        if self._mode is None and not self._reason:
            self._open()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def check(self) -> SourceReport:
        self.start()
        try:
            lines = self._read_new_lines()
        except OSError as exc:
            self._unreadable(f"reading the kernel log failed: {exc}")
            lines = []
        for index, line in enumerate(lines):
            record = self._parser.feed(line)
            if record is not None and self._is_recent(record):
                self._remember(record, index)
        status = SourceStatus.OK if self._mode else SourceStatus.UNAVAILABLE
        reason = f"reading {self._mode}" if self._mode else self._reason
        return SourceReport(self.name, status, reason, list(self._faults.values()))

    # --- opening: kmsg, else dmesg, else say why once ---------------------------------------

    def _open(self) -> None:
        if self._file_path is not None:
            self._mode = "file"
            return
        try:
            self._fd = os.open(self._kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
            self._mode = "kmsg"
            return
        except OSError as exc:
            kmsg_error = exc
        result = self._dmesg()
        if result is not None:
            self._mode = "dmesg"
            return
        self._unreadable(f"{UNREADABLE_HINT} ({self._kmsg_path}: {kmsg_error.strerror})")

    def _unreadable(self, reason: str) -> None:
        self._mode, self._reason = None, reason
        self.close()
        if not self._warned:  # once: a per-poll warning would flood the agent's log
            log.warning("GPU probe: %s", reason)
            self._warned = True

    def _dmesg(self) -> str | None:
        try:
            done = self._run(["dmesg", "--kernel"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    # --- reading ----------------------------------------------------------------------------

    def _read_new_lines(self) -> list[str]:
        if self._mode == "kmsg":
            return self._read_kmsg()
        if self._mode == "dmesg":
            # dmesg has no cursor: reread the buffer, the timestamp filter and keys de-duplicate.
            text = self._dmesg()
            if text is None:
                raise OSError(errno.EPERM, "dmesg stopped working")
            self._parser = XidParser()
            return text.splitlines()
        if self._mode == "file":
            return self._read_file()
        return []

    def _read_kmsg(self) -> list[str]:
        assert self._fd is not None
        lines: list[str] = []
        while True:
            try:
                chunk = os.read(self._fd, 16384)  # one record per read()
            except BlockingIOError:
                return lines
            except BrokenPipeError:
                continue  # records were overwritten before we read them; go on with the next
            if not chunk:
                return lines
            lines.extend(chunk.decode("utf-8", "replace").splitlines())

    def _read_file(self) -> list[str]:
        assert self._file_path is not None
        try:
            with self._file_path.open("rb") as fh:
                fh.seek(self._file_offset)
                data = fh.read()
        except FileNotFoundError:
            return []  # the site's prolog has not written anything yet
        complete = data.rfind(b"\n") + 1  # leave a half-written last line for next time
        self._file_offset += complete
        return data[:complete].decode("utf-8", "replace").splitlines()

    def _is_recent(self, record: XidRecord) -> bool:
        # Lines without a boot-relative stamp (file, dmesg -T) cannot be older than the file.
        return record.monotonic_s is None or record.monotonic_s >= self._since

    def _remember(self, record: XidRecord, index: int) -> None:
        # One fault per burst: a single Xid 13 prints a line per SM within the same second.
        when = int(record.monotonic_s) if record.monotonic_s is not None else (
            f"{self._file_offset}.{index}"
        )
        key = f"{record.xid}:{record.pci_bus}:{record.pid}:{when}"
        if key not in self._faults:
            gpu = self._bus_map().get(record.pci_bus)
            source = "kmsg" if self._mode == "kmsg" else (self._mode or "kernel_log")
            self._faults[key] = xid_fault(record, source, gpu, key)
