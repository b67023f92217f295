"""`slurmft config show` (plain and --json) byte for byte as it was recorded.

The records under tests/fixtures/config/ were taken from the CLI as root with an empty
environment (`env -i PATH=$PATH HOME=/tmp/cfgh python -m slurmft ...`) and no
/etc/slurmft/slurmft.toml: once with nothing set, once with a site file, environment variables
and --set flags. The output is an interface (scripts read the JSON; people diff the text), so any
change to it shows up here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import slurmft.config
from slurmft.cli import main

REPO = Path(__file__).resolve().parents[2]
RECORDS = REPO / "tests" / "fixtures" / "config"

OVERRIDE_FLAGS = [
    "--config",
    "tests/fixtures/config/site.toml",  # relative: the recorded source names it so
    "--set",
    "policy.max_restarts_without_progress=7",
    "--set",
    "database.url=postgresql://alice:secret@db1/slurmft",
    "--set",
    "log.level=DEBUG",
]
OVERRIDE_ENVIRONMENT = {
    "SLURMFT_DAEMON_POLL_INTERVAL_S": "2.5",
    "SLURMFT_DAEMON_OBSERVE_ONLY": "yes",
    "SLURMFT_PATHS_STATE_DIR": "/srv/slurmft/state",
    "SLURMFT_TRUST_DRAINS_PER_HOUR": "9",
    "SLURMFT_LOG_LEVEL": "ERROR",
}
CASES = {
    "show-default.json": ([], {}, ["config", "show", "--json"]),
    "show-default.txt": ([], {}, ["config", "show"]),
    "show-overrides.json": (OVERRIDE_FLAGS, OVERRIDE_ENVIRONMENT, ["config", "show", "--json"]),
    "show-overrides.txt": (OVERRIDE_FLAGS, OVERRIDE_ENVIRONMENT, ["config", "show"]),
}


@pytest.fixture
def recorded_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment the records were taken in: root, no slurmft variables, no system file."""
    for name in list(os.environ):
        if name.startswith("SLURMFT_") or name.startswith("XDG_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurmft.config, "SYSTEM_CONFIG", tmp_path / "absent.toml")
    monkeypatch.chdir(REPO)


@pytest.mark.usefixtures("recorded_environment")
@pytest.mark.parametrize("record", sorted(CASES))
def test_config_show_is_unchanged(
    record: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flags, environment, command = CASES[record]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    try:
        main([*flags, *command])
    except SystemExit as exc:
        assert exc.code in (0, None)
    out, err = capsys.readouterr()
    assert err == ""
    assert out == (RECORDS / record).read_text()
