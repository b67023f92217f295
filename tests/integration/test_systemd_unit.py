"""The systemd unit: `systemd-analyze verify` accepts it, and it keeps the promises the docs make.

verify checks that ExecStart's binary exists. The unit names the documented install path
(/opt/slurmft/venv/bin/slurmft), which a development machine does not have, so unless slurmft is
installed there the test verifies inside a private mount namespace where a tmpfs over /opt holds
a stub at that path: the host's /opt is never touched. Where namespaces are not allowed (an
unprivileged container) it creates the stub on the host and removes what it created.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "slurmft.service"
STUB = "#!/bin/sh\nexit 0\n"


def _directives(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def _exec_path() -> Path:
    return Path(shlex.split(_directives(UNIT)["ExecStart"][0])[0])


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        why = "systemd-analyze is missing (Debian: apt-get install systemd; scripts/test does)"
        if os.environ.get("SLURMFT_TEST_REQUIRE"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return path


def _verify_in_namespace(analyze: str, exec_path: Path) -> subprocess.CompletedProcess[str] | None:
    top = Path("/", exec_path.parts[1])  # /opt
    stub = shlex.quote(str(exec_path))
    script = (
        f"mount -t tmpfs slurmft-verify {shlex.quote(str(top))} && "
        f"mkdir -p {shlex.quote(str(exec_path.parent))} && "
        f"printf %s {shlex.quote(STUB)} > {stub} && chmod 755 {stub} && "
        f"exec {shlex.quote(analyze)} verify {shlex.quote(str(UNIT))}"
    )
    if shutil.which("unshare") is None or not top.is_dir():
        return None
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return None  # no mount namespaces here
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _verify_with_host_stub(analyze: str, exec_path: Path) -> subprocess.CompletedProcess[str]:
    created = [p for p in [exec_path, *exec_path.parents] if not p.exists()]
    exec_path.parent.mkdir(parents=True, exist_ok=True)
    exec_path.write_text(STUB)
    exec_path.chmod(0o755)
    try:
        return subprocess.run(
            [analyze, "verify", str(UNIT)], capture_output=True, text=True, timeout=60, check=False
        )
    finally:
        for path in created:  # the file first, then the folders it needed, innermost first
            path.unlink() if path.is_file() else path.rmdir()


def test_systemd_analyze_verify_passes() -> None:
    analyze = _systemd_analyze()
    exec_path = _exec_path()
    if exec_path.exists():
        result = subprocess.run(
            [analyze, "verify", str(UNIT)], capture_output=True, text=True, timeout=60, check=False
        )
    else:
        result = _verify_in_namespace(analyze, exec_path) or _verify_with_host_stub(
            analyze, exec_path
        )
    assert result.returncode == 0 and not result.stderr.strip(), result.stdout + result.stderr


def test_unit_is_a_hardened_notify_service_that_keeps_the_gpus_visible() -> None:
    d = _directives(UNIT)
    assert d["Type"] == ["notify"]
    assert d["ExecStart"] == ["/opt/slurmft/venv/bin/slurmft daemon"]
    assert d["Restart"] == ["on-failure"]
    assert int(d["WatchdogSec"][0]) > 0
    assert d["User"] == ["slurmft"]
    for directory in ("StateDirectory", "ConfigurationDirectory", "RuntimeDirectory"):
        assert d[directory] == ["slurmft"]
    for hardening in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert d[hardening] == ["yes"]
    assert d["ProtectSystem"] == ["strict"]
    assert "PrivateDevices" not in d  # it hides /dev/nvidia*


def test_example_config_loads_and_matches_the_unit(tmp_path: Path) -> None:
    from slurmft.config import load_config

    config = load_config(
        config_file=REPO / "systemd" / "slurmft.toml",
        environ={},
        system_file=tmp_path / "absent.toml",
    )
    environment = dict(v.split("=", 1) for v in _directives(UNIT)["Environment"])
    assert config.settings.paths.state_dir == environment["SLURMFT_PATHS_STATE_DIR"]
    assert config.settings.paths.runtime_dir == environment["SLURMFT_PATHS_RUNTIME_DIR"]
    assert config.settings.daemon.metrics_listen.startswith("127.0.0.1:")  # localhost by default


def test_the_units_file_and_task_limits_hold_the_daemons_caps() -> None:
    """Each connection the daemon may hold is a descriptor, each answering thread a task: the
    unit's limits must leave room for the caps' defaults and for the rest of the daemon (the
    store's pool, logs, the scheduler, Slurm commands), or a flood ends in EMFILE or EAGAIN
    instead of a 503."""
    from slurmft.config import DaemonSection
    from slurmft.controller.health import OPS_LIMITS

    d = _directives(UNIT)
    nofile, tasks = int(d["LimitNOFILE"][0]), int(d["TasksMax"][0])
    connections = (
        DaemonSection.ingest_max_connections
        + DaemonSection.socket_max_connections
        + OPS_LIMITS.max_connections
    )
    threads = DaemonSection.ingest_workers + DaemonSection.socket_workers + OPS_LIMITS.workers
    assert connections + 1024 <= nofile <= 1_048_576
    assert threads + 64 <= tasks <= 4 * (threads + 64)
