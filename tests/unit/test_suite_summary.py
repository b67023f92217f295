"""scripts/lib/suite_summary.py: both phases of scripts/test added up, and the time budget."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lib" / "suite_summary.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("suite_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["suite_summary"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def junit(path: Path, tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> str:
    # The shape pytest's --junitxml writes: one <testsuite> in a <testsuites>.
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
        f'<testsuite name="pytest" errors="{errors}" failures="{failures}" '
        f'skipped="{skipped}" tests="{tests}" time="1.0"></testsuite></testsuites>'
    )
    return str(path)


def run(tmp_path: Path, *phases: tuple[str, int, dict[str, int] | None], wall_s: float = 10):
    summary = load()
    argv = ["--budget-s", "100", "--wall-s", str(wall_s)]
    for name, rc, counts in phases:
        report = tmp_path / f"{name}.xml"
        path = junit(report, **counts) if counts is not None else str(report)
        argv += ["--phase", name, str(rc), path]
    return summary.main(argv)


def test_both_phases_are_added_up_in_one_closing_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run(
        tmp_path,
        ("parallel", 0, {"tests": 10, "skipped": 1}),
        ("serial", 0, {"tests": 3}),
    )
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert lines[-1] == "suite: 12 passed, 0 failed, 1 skipped"
    assert lines[-2] == "suite wall time 10 s of a 100 s budget"


def test_a_failure_or_an_error_in_either_phase_fails_the_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run(
        tmp_path,
        ("parallel", 1, {"tests": 10, "failures": 1, "errors": 1}),
        ("serial", 0, {"tests": 3}),
    )
    assert code == 1
    assert capsys.readouterr().out.splitlines()[-1] == "suite: 11 passed, 2 failed, 0 skipped"


def test_a_phase_the_arguments_left_empty_is_fine_but_no_test_at_all_is_not(
    tmp_path: Path,
) -> None:
    one_empty = (("parallel", 5, {"tests": 0}), ("serial", 0, {"tests": 2}))
    assert run(tmp_path, *one_empty) == 0
    assert run(tmp_path, ("parallel", 5, {"tests": 0}), ("serial", 5, {"tests": 0})) == 1


def test_a_crashed_phase_without_a_report_fails(tmp_path: Path) -> None:
    assert run(tmp_path, ("parallel", 3, None), ("serial", 0, {"tests": 2})) == 1


def test_static_checks_that_ran_beside_the_tests_fail_the_suite_when_they_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = load()
    argv = ["--budget-s", "100", "--wall-s", "10",
            "--phase", "serial", "0", junit(tmp_path / "serial.xml", tests=2)]  # fmt: skip
    assert summary.main([*argv, "--static-checks", "0"]) == 0
    assert "(import contracts, mypy): passed" in capsys.readouterr().out
    assert summary.main([*argv, "--static-checks", "1"]) == 1
    out = capsys.readouterr().out
    assert "(import contracts, mypy): FAILED (exit 1" in out
    assert out.splitlines()[-1] == "suite: 2 passed, 0 failed, 0 skipped"


def test_over_the_budget_fails_even_when_every_test_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path, ("parallel", 0, {"tests": 5}), wall_s=101) == 1
    assert "OVER BUDGET" in capsys.readouterr().out


def test_the_cpu_time_is_the_machines_busy_time_since_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the first line of /proc/stat at the start to now: every field but idle and
    iowait, in clock ticks."""
    summary = load()
    ticks = summary.os.sysconf("SC_CLK_TCK")
    start = "cpu  100 0 50 9000 7 0 0 0 0 0"
    end = f"cpu  {100 + 3 * ticks} 0 {50 + ticks} {9000 + 40 * ticks} {7 + 5 * ticks} 0 0 0 0 0"
    assert summary.busy_cpu_s(start, end) == pytest.approx(4.0)
    argv = ["--budget-s", "100", "--wall-s", "10", "--cpu-at-start", start,
            "--phase", "serial", "0", junit(tmp_path / "serial.xml", tests=1)]  # fmt: skip
    assert summary.main(argv) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("suite CPU")]
    now = Path("/proc/stat").read_text().splitlines()[0]
    assert int(line.split()[3]) == pytest.approx(summary.busy_cpu_s(start, now), abs=2)


def test_each_failure_is_shown_with_its_message_before_the_closing_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CI shows the log's tail: the first phase's failures are repeated there, each with the
    start of its message, as pytest's --junitxml wrote them."""
    long_message = "assert 5 <= 4, " + "x" * 5000
    attribute = long_message.replace("<", "&lt;")
    (tmp_path / "parallel.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
        '<testsuite name="pytest" errors="1" failures="1" skipped="0" tests="3" time="1.0">'
        '<testcase classname="tests.integration.slurm.test_crash_loop_e2e" name="test_cap">'
        f'<failure message="{attribute}">traceback</failure></testcase>'
        '<testcase classname="tests.unit.test_suite_summary.TestY" name="test_z[sqlite]">'
        '<error message="failed on setup with &quot;OSError: port in use&quot;">tb</error>'
        '</testcase><testcase classname="tests.unit.test_suite_summary" name="test_ok" />'
        "</testsuite></testsuites>"
    )
    summary = load()
    argv = ["--budget-s", "100", "--wall-s", "10",
            "--phase", "parallel", "1", str(tmp_path / "parallel.xml"),
            "--phase", "serial", "0", junit(tmp_path / "serial.xml", tests=2)]  # fmt: skip
    assert summary.main(argv) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == (
        "failed in phase parallel: tests/integration/slurm/test_crash_loop_e2e.py::test_cap"
    )
    assert lines[1].startswith("    assert 5 <= 4, xxx")
    assert lines[1].endswith(f"x [... {len(long_message)} characters in all]")
    assert len(lines[1]) < summary.FAILURE_SHOWN_CHARS + 60
    assert lines[2:4] == [
        "failed in phase parallel: tests/unit/test_suite_summary.py::TestY::test_z[sqlite]",
        '    failed on setup with "OSError: port in use"',
    ]
    assert lines[4] == "phase parallel: 1 passed, 2 failed, 0 skipped (pytest exit 1)"
    assert lines[-1] == "suite: 3 passed, 2 failed, 0 skipped"


def test_past_five_failures_the_rest_are_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = "".join(
        f'<testcase classname="tests.unit.test_suite_summary" name="test_{i}">'
        f'<failure message="m{i}" /></testcase>'
        for i in range(7)
    )
    (tmp_path / "serial.xml").write_text(
        '<testsuites><testsuite name="pytest" errors="0" failures="7" skipped="0" tests="7">'
        f"{cases}</testsuite></testsuites>"
    )
    summary = load()
    argv = ["--budget-s", "100", "--wall-s", "10",
            "--phase", "serial", "1", str(tmp_path / "serial.xml")]  # fmt: skip
    assert summary.main(argv) == 1
    shown = [x for x in capsys.readouterr().out.splitlines() if x.startswith("failed in")]
    module = "tests/unit/test_suite_summary.py"
    assert shown[:5] == [f"failed in phase serial: {module}::test_{i}" for i in range(5)]
    assert shown[5:] == ["failed in phase serial: 2 more (pytest's report)"]
