"""The CLI as a user runs it: in-process for speed, and once from an installed wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft.db import Database
from slurmft.db.models import Event, EventKind, FaultClass, Run
from slurmft.db.states import RunState
from tests.support.cli import run_cli

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith("SLURMFT_") and not name.startswith("SLURMFT_TEST_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURMFT_PATHS_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


def test_config_show_json_says_where_values_come_from(
    isolated_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = isolated_env / "c.toml"
    conf.write_text('[daemon]\npoll_interval_s = 2.5\n')
    monkeypatch.setenv("SLURMFT_CONFIG", str(conf))
    code, out, _ = run_cli(capsys, "--set", "log.format=json", "config", "show", "--json")
    assert code == 0
    data = json.loads(out)
    settings = data["settings"]
    assert settings["daemon.poll_interval_s"] == {"value": 2.5, "source": str(conf)}
    assert settings["paths.state_dir"]["source"] == "env SLURMFT_PATHS_STATE_DIR"
    assert settings["log.format"] == {"value": "json", "source": "flag --set"}
    assert settings["log.level"] == {"value": "INFO", "source": "default"}
    assert data["resolved"]["database_url"] == f"sqlite:///{isolated_env}/state/slurmft.db"


def test_bad_config_is_one_clear_line_and_exit_2(
    isolated_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMFT_DAEMON_POLL_INTERVAL_S", "often")
    code, out, err = run_cli(capsys, "config", "show")
    assert code == 2 and out == ""
    assert err.startswith("slurmft: error: bad value for daemon.poll_interval_s")
    assert "Traceback" not in err


def test_db_commands_and_history(
    isolated_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "db", "check")
    assert code == 1 and "run `slurmft db upgrade`" in err
    code, _, err = run_cli(capsys, "history", "show", "node_lemons", "--store")
    assert code == 1 and "run `slurmft db upgrade`" in err

    code, out, _ = run_cli(capsys, "db", "upgrade")
    assert code == 0 and "(empty) -> " in out
    code, out, _ = run_cli(capsys, "db", "current", "--json")
    status = json.loads(out)
    assert status["at_head"] is True and status["current"] == status["head"]
    assert run_cli(capsys, "db", "check")[0] == 0

    database = Database(f"sqlite:///{isolated_env}/state/slurmft.db")
    with database.session() as s:
        run = Run(id="r1", name="llama", owner_uid=0, owner_name="root", nodes=2, command=["x"])
        s.add(run)
        s.flush()
        run.state = RunState.RUNNING
        s.add(Event(run_id="r1", kind=EventKind.GPU_FAULT, node="n4", xid=79,
                    fault_class=FaultClass.HARDWARE, time_lost_s=90.0))
    database.dispose()
    code, out, _ = run_cli(capsys, "history", "show", "failures_by_node", "--json", "--store")
    assert code == 0
    rows = json.loads(out)
    assert [(r["node"], r["xid"], r["failures"]) for r in rows] == [("n4", 79, 1)]
    code, out, _ = run_cli(capsys, "history", "show", "run_failures", "--run", "r1", "--store")
    assert code == 0 and "llama" in out and "90.000" in out
    code, _, err = run_cli(capsys, "history", "show", "nope")
    assert code == 1 and "choose one of" in err


def test_help_explains_every_group(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for group in ("config", "db", "history"):
        assert group in out


def test_daemon_side_modules_never_import_torch() -> None:
    """Import every slurmft module except the training library; torch must stay out."""
    script = (
        "import pkgutil, sys, importlib, slurmft\n"
        "names = [m.name for m in pkgutil.walk_packages(slurmft.__path__, 'slurmft.')\n"
        "         if not m.name.startswith('slurmft.train') and m.name != 'slurmft.__main__']\n"
        "for name in names: importlib.import_module(name)\n"
        "assert len(names) > 10, names\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(names), 'modules;', 'torch imported' if bad else 'no torch')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().endswith("no torch"), result.stdout + result.stderr


def test_installed_wheel_works_outside_the_repo(tmp_path: Path) -> None:
    """Build the wheel, install it elsewhere, and run the CLI from a directory with no repo."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(REPO)],
        check=True, capture_output=True,
    )
    (wheel,) = wheels.glob("slurmft-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True,
    )
    assert (target / "slurmft" / "migrations" / "env.py").is_file()
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    env.update(PYTHONPATH=str(target), SLURMFT_PATHS_STATE_DIR=str(tmp_path / "state"))
    slurmft_bin = [str(target / "bin" / "slurmft")]

    def run(*argv: str) -> str:
        done = subprocess.run([*slurmft_bin, *argv], cwd=workdir, env=env, capture_output=True,
                              text=True, check=True)
        return done.stdout

    assert "history" in run("--help")
    assert json.loads(run("config", "show", "--json"))["resolved"]["database_url"].endswith(
        "state/slurmft.db")
    assert "(empty) -> " in run("db", "upgrade")
    where = subprocess.run(
        [sys.executable, "-c", "from slurmft.db.database import migrations_dir; "
         "print(migrations_dir())"], cwd=workdir, env=env, capture_output=True, text=True,
        check=True).stdout.strip()
    assert where == str(target / "slurmft" / "migrations")
