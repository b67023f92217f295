"""A test's run that overruns its time fails with what it was doing (tests/support/processes.py):
here a launcher waiting on a child that never ends, as torchrun waits on a rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.processes import run_dumping_stacks_on_overrun

CHILD = """
import time
from slurmft.train.stacks import install_stack_dump
install_stack_dump(1)
print("child ready", flush=True)
def stuck_in_the_child():
    time.sleep(600)
stuck_in_the_child()
"""
LAUNCHER = f"""
import subprocess, sys
def waiting_in_the_launcher():
    subprocess.run([sys.executable, "-c", {CHILD!r}], start_new_session=True)
waiting_in_the_launcher()
"""


def test_a_run_that_overruns_fails_with_every_process_stack(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as failure:
        run_dumping_stacks_on_overrun(
            [sys.executable, "-c", LAUNCHER],
            timeout_s=5,
            stacks_dir=tmp_path / "stacks",
            env={"PATH": str(Path(sys.executable).parent)},
            cwd=tmp_path,
        )
    report = str(failure.value)
    assert "overran 5 s" in report
    # The child (its own session, as torchrun starts ranks) wrote its dump and was then killed;
    # the launcher wrote its stack on the SIGABRT that ended it.
    assert "--- stacks-rank1-pid" in report and "stuck_in_the_child" in report, report
    assert "waiting_in_the_launcher" in report, report
    assert "child ready" in report


def test_a_run_that_ends_in_time_returns_its_output(tmp_path: Path) -> None:
    done = run_dumping_stacks_on_overrun(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
        timeout_s=60,
        stacks_dir=tmp_path / "stacks",
        env={},
        cwd=tmp_path,
    )
    assert done.returncode == 0 and "out" in done.stdout and "err" in done.stdout
