"""A stop does not wait on Slurm: the command a control pass waits on is ended, and a pass stuck
elsewhere is left behind after a grace, so systemd's stop (SIGTERM, then SIGKILL 60 s later)
ends in the daemon's own clean exit. In-process daemon on SQLite; Slurm commands that hang are
scripts on PATH (a 600 s `sleep`, with the daemon's command timeout at 600 s)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from support.daemon_side import BlockedSlurm, daemon_config
from support.waiting import wait_for

from slurmft.controller import daemon as daemon_module
from slurmft.controller.daemon import Daemon
from slurmft.db import Database

TESTS = Path(__file__).parents[1]  # the subprocess imports support/ from there
HANGING_COMMAND = """#!/bin/sh
# Unreachable until {flag} exists; then it hangs, as against a wedged slurmctld.
[ -e {flag} ] || {{ echo "Unable to contact slurm controller (connect failure)" >&2; exit 1; }}
echo $$ >> {started}
exec sleep 600
"""


def _daemon(tmp_path: Path, slurm: Any = None) -> Daemon:
    config = daemon_config(tmp_path, "slurm.command_timeout_s=600")
    database = Database(config.database_url)
    database.upgrade()
    return Daemon(config, database=database, slurm=slurm)


def _stop_in_thread(daemon: Daemon) -> list[bool]:
    """``daemon.stop()``'s answer, or nothing when it did not return within 60 s."""
    answer: list[bool] = []
    stopper = threading.Thread(target=lambda: answer.append(daemon.stop()))
    stopper.start()
    stopper.join(timeout=60)
    return answer


def test_a_stop_ends_the_slurm_command_the_pass_waits_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    flag, started = tmp_path / "hang", tmp_path / "started"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "scontrol", "sinfo", "sacct"):
        script = bin_dir / name
        script.write_text(HANGING_COMMAND.format(flag=flag, started=started))
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    caplog.set_level(logging.INFO, logger="slurmft.controller.daemon")
    daemon = _daemon(tmp_path).start()
    flag.touch()
    pid = int(wait_for(lambda: started.exists() and started.read_text().split(), 30,
                       "a control pass to wait on a hanging Slurm command")[0])  # fmt: skip

    assert _stop_in_thread(daemon) == [True], "the stop waited on the 600 s command"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "control pass cut short by the stop; nothing decided" in caplog.messages
    assert started.read_text().split() == [str(pid)], "a Slurm command started after the stop"


def test_a_pass_stuck_elsewhere_is_left_behind_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(daemon_module, "STOP_GRACE_S", 0.5)
    slurm = BlockedSlurm()
    daemon = _daemon(tmp_path, slurm).start()
    try:
        assert slurm.blocked.wait(30)
        assert _stop_in_thread(daemon) == [False]
        (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert error.startswith("the control pass in flight did not end within 0.5s of the stop")
    finally:
        slurm.release.set()


STUCK_DAEMON = """
import sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from support.daemon_side import BlockedSlurm, daemon_config
from slurmft.controller import daemon as daemon_module
from slurmft.db import Database
from slurmft.logs import setup_logging

config = daemon_config(Path(sys.argv[1]))
database = Database(config.database_url)
database.upgrade()
daemon_module.STOP_GRACE_S = 0.5
setup_logging()
slurm = BlockedSlurm()
threading.Thread(target=lambda: slurm.blocked.wait() and print("BLOCKED", flush=True)).start()
daemon_module.Daemon(config, database=database, slurm=slurm).run_until_signalled()
"""


def test_sigterm_with_a_stuck_pass_exits_instead_of_waiting_for_it(tmp_path: Path) -> None:
    """The interpreter would wait for the stuck pass's thread at exit: the daemon exits
    without it, non-zero, saying so."""
    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-c", STUCK_DAEMON, str(tmp_path), str(TESTS)],
            stdout=subprocess.PIPE, stderr=out, text=True,
        )  # fmt: skip
    try:
        assert daemon.stdout is not None
        assert daemon.stdout.readline() == "BLOCKED\n", log.read_text()
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 1, log.read_text()
    finally:
        daemon.kill()
        daemon.wait()
    text = log.read_text()
    assert "signal SIGTERM: stopping" in text
    assert "did not end within 0.5s of the stop" in text


def test_a_pass_that_outlasts_its_ticks_is_said_once_not_per_tick(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass held past several 0.5 s ticks: one WARNING when the first tick is skipped, one INFO
    when it ends with the ticks it skipped, and none of APScheduler's per-tick lines."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="apscheduler")  # as a fresh process has it
    slurm = BlockedSlurm()
    daemon = _daemon(tmp_path, slurm).start()
    registry = daemon.metrics.registry
    busy = {"job": "control", "reason": "busy"}
    try:
        assert slurm.blocked.wait(30)
        wait_for(lambda: (registry.get_sample_value("slurmft_scheduler_jobs_skipped_total", busy)
                          or 0) >= 3, 30, "three ticks skipped for the blocked pass")  # fmt: skip
        slurm.release.set()
        wait_for(lambda: any("control job ended after" in m for m in caplog.messages), 30,
                 "the end of the blocked pass logged")  # fmt: skip
    finally:
        slurm.release.set()
        daemon.stop()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert not [m for _, m in lines if "maximum number of running instances" in m]
    overrun = [
        (level, m) for level, m in lines if m.startswith(("control job still", "control job ended"))
    ]
    (first_level, first), (end_level, end) = overrun[:2]
    assert (first_level, end_level) == ("WARNING", "INFO")
    assert first.startswith("control job still running after")
    ticks = int(end.split("; ")[1].split()[0])
    assert ticks >= 3, end
