"""The closing lines of `scripts/test`: both pytest phases added up, and the suite's time budget.

Usage (scripts/test calls it):
    suite_summary.py --budget-s 2700 --wall-s 812 [--cpu-at-start "$(head -1 /proc/stat)"] \\
        --phase parallel RC results/parallel.xml --phase serial RC results/serial.xml \
        [--static-checks RC]

Prints each failed test with the start of its message (CI shows a log's tail, which pytest's
own report of a first phase's failures may not reach), one line per phase, the wall time against
the budget, the CPU time the machine was busy for meanwhile (from /proc/stat: Slurm, PostgreSQL
and every process the tests start, counted; what decides the suite's wall time on two cores),
the exit status of the static checks when they ran beside
the tests (the import contracts and mypy: their output is printed before this), and last a plain
closing line `suite: N passed, N failed, N skipped` for the whole suite. Exits 0 only when every
phase passed (pytest's exit 5, "no tests collected", is fine for one phase while another ran
tests), the suite ran at least one test, the static checks passed, and it stayed inside the
budget.
"""

from __future__ import annotations

import argparse
import os
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

NO_TESTS_COLLECTED = 5


@dataclass(frozen=True)
class Counts:
    passed: int = 0
    failed: int = 0  # failures and errors
    skipped: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.passed + other.passed, self.failed + other.failed, self.skipped + other.skipped
        )

    @property
    def ran(self) -> int:
        return self.passed + self.failed

    def line(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"


def read_junit(path: Path) -> Counts:
    """The counts of one pytest --junitxml report (a <testsuites> of one <testsuite>)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = Counts()
    for suite in suites:
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        total += Counts(tests - failed - skipped, failed, skipped)
    return total


FAILURE_SHOWN_CHARS = 1500  # of each failure's message: the assertion and its first context
FAILURES_SHOWN = 5


@dataclass(frozen=True)
class Failure:
    test: str  # pytest's node id, as near as the report names it
    message: str


def read_failures(path: Path) -> list[Failure]:
    """The failed and errored tests of one pytest --junitxml report, with their messages."""
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for outcome in (*case.iter("failure"), *case.iter("error")):
            test = node_id(case.get("classname", ""), case.get("name", ""))
            failures.append(Failure(test, outcome.get("message") or (outcome.text or "")))
    return failures


def node_id(classname: str, name: str) -> str:
    """pytest's node id from a report's dotted classname ("tests.unit.test_x" or, for a test in
    a class, "tests.unit.test_x.TestY") and the test's name."""
    parts = classname.split(".") if classname else []
    classes: list[str] = []
    while parts and parts[-1][:1].isupper():
        classes.insert(0, parts.pop())
    module = "/".join(parts) + ".py" if parts else ""
    return "::".join(p for p in (module, *classes, name) if p)


def show_failures(phase: str, failures: list[Failure]) -> None:
    for failure in failures[:FAILURES_SHOWN]:
        message = failure.message.strip()
        if len(message) > FAILURE_SHOWN_CHARS:
            message = message[:FAILURE_SHOWN_CHARS] + f" [... {len(message)} characters in all]"
        print(f"failed in phase {phase}: {failure.test}\n    {message}")
    if len(failures) > FAILURES_SHOWN:
        print(f"failed in phase {phase}: {len(failures) - FAILURES_SHOWN} more (pytest's report)")


def busy_cpu_s(start: str, end: str) -> float:
    """CPU seconds the machine was busy between two first lines of /proc/stat ("cpu  user nice
    system idle iowait irq softirq steal ..." in clock ticks): all but idle and iowait."""
    before, after = (list(map(int, line.split()[1:])) for line in (start, end))
    spent = [b - a for a, b in zip(before, after, strict=True)]
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(spent) - spent[3] - spent[4]) / ticks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--wall-s", type=float, required=True)
    parser.add_argument("--cpu-at-start", help="the first line of /proc/stat when the suite began")
    parser.add_argument("--phase", nargs=3, action="append", metavar=("NAME", "RC", "JUNIT"))
    parser.add_argument(
        "--static-checks", type=int, metavar="RC", help="their exit status, when they ran beside"
    )
    args = parser.parse_args(argv)

    phases = [(name, int(rc), Path(junit)) for name, rc, junit in args.phase or []]
    for name, _, report in phases:
        if report.exists():
            show_failures(name, read_failures(report))
    total, ok = Counts(), True
    for name, rc, report in phases:
        if not report.exists():
            print(f"phase {name}: pytest exited {rc} and wrote no report", flush=True)
            ok = False
            continue
        counts = read_junit(report)
        total += counts
        print(f"phase {name}: {counts.line()} (pytest exit {rc})")
        ok &= rc in (0, NO_TESTS_COLLECTED)
    if total.ran == 0:
        print("no test ran")
        ok = False
    if args.static_checks is not None:
        passed = args.static_checks == 0
        print(
            "static checks beside the tests (import contracts, mypy): "
            + ("passed" if passed else f"FAILED (exit {args.static_checks}; their output is above)")
        )
        ok &= passed
    within = args.wall_s <= args.budget_s
    print(
        f"suite wall time {args.wall_s:.0f} s of a {args.budget_s:.0f} s budget"
        + ("" if within else ": OVER BUDGET (docs/testing.md says what to do)")
    )
    if args.cpu_at_start:
        cpu_s = busy_cpu_s(args.cpu_at_start, Path("/proc/stat").read_text().splitlines()[0])
        cores = cpu_s / args.wall_s if args.wall_s > 0 else 0.0
        print(f"suite CPU time {cpu_s:.0f} s, the whole machine's ({cores:.2f} cores on average)")
    print(f"suite: {total.line()}")
    return 0 if ok and within else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
