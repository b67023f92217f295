#!/usr/bin/env python3
"""Where a command's CPU goes, by kind of process and by test: made for `scripts/test`, whose
wall time on two cores is set by the CPU its end-to-end tests spend (docs/testing.md).

    sudo .venv/bin/python scripts/bench/suite_cpu.py [--top 25] -- scripts/test [ARGS]

Every process that exits while the command runs is counted, children of Slurm's daemons
included, with the kernel's process accounting (`accton`, `dump-acct`: Debian's `acct`
package; root). The accounting record has a process's CPU time and its parent but only a
16-character name, so a sampler reads each new process's command line from /proc every
SAMPLE_S. A process forked without exec shows its parent's command line and is counted as
its kind ", forked"; a zygote (forked by its launcher) is known by its name, `slurmft-zygote`,
and its forks are warm workers. One that lived shorter than SAMPLE_S takes its parent's kind
when it forked, else the kernel's name.

Prints the CPU seconds and the share of each kind, then of each test (from the pytest folder
in the command lines: `popen-gwN/<test>N`), then the machine's busy time against the wall
time. Processes still running when the command ends (none, for scripts/test) are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# The machine's busy time, counted as scripts/test's closing lines count it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
from suite_summary import busy_cpu_s

from slurmft.agent.zygote import PROCESS_NAME as ZYGOTE_NAME

SAMPLE_S = 0.5
# A process's kind: the first pattern its command line matches.
KINDS = (
    ("launcher (torchrun)", r"slurmft\.agent\.launcher|bin/torchrun"),
    ("zygote", r"slurmft\.agent\.zygote"),
    ("rendezvous store", r"slurmft\.agent\.store"),
    ("warm-start client", r"slurmft\.agent\.warm_start"),
    ("agent or batch step", r"slurmft agent|slurmft\.agent\.(agent|batch)"),
    ("daemon", r"slurmft daemon|-m slurmft daemon"),
    ("training worker (cold)", r"slurmft\.train\.examples|examples/"),
    ("slurmft command", r"bin/slurmft|-m slurmft"),
    ("pytest", r"-m pytest|exec\(eval\(sys\.stdin"),
    ("mypy", r"mypy"),
    ("pip", r"\bpip\b"),
    ("python -c (a test's helper)", r"bin/python3? -c"),
    ("Slurm", r"slurmctld|slurmd|slurmstepd|srun|sbatch|scontrol|squeue|sinfo|sacct"),
    ("PostgreSQL", r"postgres"),
)
TEST_FOLDER = re.compile(r"pytest-\d+/(?:popen-gw\d+/)?([^/ ]+?)\d*(?:/| |$)")


@dataclass
class Record:
    name: str  # the kernel's 16-character process name
    cpu_s: float
    elapsed_s: float
    pid: int
    ppid: int
    forked: bool  # forked without exec
    began: float


def read_accounting(path: Path) -> list[Record]:
    """dump-acct's lines: name|version|utime|stime|etime|uid|gid|mem|io|pid|ppid|flags|exit|
    tty|btime, times in 1/100 s."""
    out = subprocess.run(["dump-acct", str(path)], capture_output=True, text=True, check=True)
    records = []
    for line in out.stdout.splitlines():
        f = [field.strip() for field in line.split("|")]
        began = datetime.strptime(f[-1], "%a %b %d %H:%M:%S %Y").timestamp()
        cpu = (float(f[2]) + float(f[3])) / 100
        records.append(Record(f[0], cpu, float(f[4]) / 100, int(f[9]), int(f[10]), "F" in f[11],
                              began))  # fmt: skip
    return records


class CommandLines:
    """Each process's command line, read from /proc while the command runs (pids are reused:
    each sighting keeps its time)."""

    def __init__(self) -> None:
        self.seen: dict[int, list[tuple[float, str]]] = defaultdict(list)
        self.stop = threading.Event()

    def sample(self) -> None:
        known: set[int] = set()
        while not self.stop.wait(SAMPLE_S):
            alive = {int(p) for p in os.listdir("/proc") if p.isdigit()}
            for pid in alive - known:
                try:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if raw:
                    self.seen[pid].append((time.time(), raw.replace(b"\0", b" ").decode(
                        errors="replace")))  # fmt: skip
            known = alive

    def of(self, record: Record) -> str | None:
        # dump-acct's start time is whole seconds: a sighting within the process's life.
        low, high = record.began - 1, record.began + record.elapsed_s + 2
        found = [cmd for at, cmd in self.seen.get(record.pid, []) if low <= at <= high]
        return found[-1] if found else None


def kind_of(command: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, command)), "other")


def classify(records: list[Record], lines: CommandLines) -> list[tuple[Record, str, str]]:
    """(record, kind, test) for each record. A fork without exec, unseen, is its parent's kind;
    a process whose command line names no test folder is its parent's test."""
    by_pid: dict[int, list[Record]] = defaultdict(list)
    for record in records:
        by_pid[record.pid].append(record)
    memo: dict[int, tuple[str, str]] = {}

    def parent(record: Record) -> Record | None:
        older = [p for p in by_pid[record.ppid] if p.began <= record.began + 1]
        return older[-1] if older else None

    def above(record: Record, depth: int) -> tuple[str, str]:
        up = parent(record) if depth < 8 else None
        return name(up, depth + 1) if up is not None else ("", "")

    def name(record: Record, depth: int = 0) -> tuple[str, str]:
        if id(record) not in memo:
            command = lines.of(record)
            if command is None:
                kind, in_test = above(record, depth)
                if not (record.forked and kind):
                    kind = f"unnamed: {record.name}"
                memo[id(record)] = (kind, in_test)
            else:
                # A fork keeps its parent's command line: the zygote and its warm workers show
                # their launcher's.
                kind = kind_of(command) + (", forked" if record.forked else "")
                up = parent(record)
                if record.name == ZYGOTE_NAME:
                    kind = "zygote"
                elif record.forked and up is not None and up.name == ZYGOTE_NAME:
                    kind = "warm worker"
                test = TEST_FOLDER.search(command)
                memo[id(record)] = (kind, test.group(1) if test else above(record, depth)[1])
        return memo[id(record)]

    return [(record, *name(record)) for record in records]


def table(title: str, spent: dict[str, float], top: int) -> None:
    total = sum(spent.values()) or 1.0
    print(f"\n{title}")
    for key, seconds in sorted(spent.items(), key=lambda item: -item[1])[:top]:
        print(f"{seconds:9.1f} s {100 * seconds / total:5.1f} %  {key or '(no test)'}")


def proc_stat() -> str:
    return Path("/proc/stat").read_text().splitlines()[0]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    missing = [tool for tool in ("accton", "dump-acct") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        sys.exit("needs root and Debian's acct package (accton, dump-acct): "
                 "apt-get install acct")  # fmt: skip
    lines = CommandLines()
    sampler = threading.Thread(target=lines.sample, daemon=True)
    with tempfile.TemporaryDirectory() as folder:
        accounting = Path(folder) / "pacct"
        accounting.touch()
        subprocess.run(["accton", str(accounting)], check=True, capture_output=True)
        started, stat = time.monotonic(), proc_stat()
        sampler.start()
        try:
            code = subprocess.run(command, check=False).returncode
        finally:
            subprocess.run(["accton", "off"], check=False, capture_output=True)
            lines.stop.set()
            sampler.join()
        wall, busy = time.monotonic() - started, busy_cpu_s(stat, proc_stat())
        named = classify(read_accounting(accounting), lines)
    kinds: defaultdict[str, float] = defaultdict(float)
    tests: defaultdict[str, float] = defaultdict(float)
    for record, kind, test in named:
        kinds[kind] += record.cpu_s
        tests[test] += record.cpu_s
    table(f"CPU by kind of process ({len(named)} processes)", kinds, args.top)
    table("CPU by test (its processes and theirs)", tests, args.top)
    print(
        f"\nwall {wall:.0f} s; the machine was busy {busy:.0f} s of CPU "
        f"({busy / wall:.2f} cores on average); processes counted {sum(kinds.values()):.0f} s"
    )
    print("suite_cpu " + json.dumps({"wall_s": round(wall), "busy_s": round(busy),
                                     "exit": code}))  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
