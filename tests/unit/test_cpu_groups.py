"""scripts/lib/cpu_groups.py: the weighted cpu cgroups that scripts/test runs each phase in when
the serial group runs beside the parallel phase (SLURMFT_TEST_SERIAL_BESIDE=1)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support.waiting import wait_for

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lib" / "cpu_groups.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_groups", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpu_groups"] = module
    spec.loader.exec_module(module)
    return module


cpu_groups = _load()


def fake_v1(fs: Path) -> Path:
    (fs / "cpu").mkdir(parents=True)
    (fs / "cpu" / "cgroup.procs").write_text("")
    return fs / "cpu"


def fake_v2(fs: Path, controllers: str) -> Path:
    fs.mkdir(parents=True, exist_ok=True)
    (fs / "cgroup.controllers").write_text(controllers + "\n")
    (fs / "cgroup.subtree_control").write_text("")
    return fs


def test_v1_group_gets_its_shares(tmp_path: Path) -> None:
    base = fake_v1(tmp_path)
    group = cpu_groups.up("serial", 4096, tmp_path)
    assert group == base / "serial"
    assert (group / "cpu.shares").read_text() == "4096"


def test_v2_hands_the_controller_down_and_scales_the_weight(tmp_path: Path) -> None:
    fake_v2(tmp_path, "cpuset cpu io memory pids")
    group = cpu_groups.up("parallel", 512, tmp_path)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    assert (group / "cpu.weight").read_text() == "50"  # 512 of v1's 1024 is 50 of v2's 100


@pytest.mark.parametrize("controllers", ["cpuset io memory", None])
def test_no_cpu_controller_is_unavailable_and_says_why(tmp_path: Path, controllers: str | None):
    if controllers is not None:
        fake_v2(tmp_path, controllers)
    with pytest.raises(cpu_groups.Unavailable, match=r"no cpu (controller|cgroup)"):
        cpu_groups.up("serial", 4096, tmp_path)
    assert not (tmp_path / "serial").exists()


def test_a_group_that_exists_already_is_not_adopted(tmp_path: Path) -> None:
    (fake_v1(tmp_path) / "serial").mkdir()
    with pytest.raises(cpu_groups.Unavailable, match="cannot make the cgroup"):
        cpu_groups.up("serial", 4096, tmp_path)


def test_the_command_line_prints_the_group_or_why_not(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_groups, "CGROUP_FS", tmp_path)
    assert cpu_groups.main(["up", "serial", "4096"]) == 1
    assert "no cpu cgroup controller" in capsys.readouterr().err
    fake_v1(tmp_path)
    assert cpu_groups.main(["up", "serial", "4096"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cpu" / "serial")
    assert cpu_groups.main(["sideways"]) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="making a real cgroup needs root")
def test_a_real_group_holds_what_joins_it_and_down_hands_the_rest_to_its_parent() -> None:
    try:
        group = cpu_groups.up(f"slurmft-test-unit-{os.getpid()}", 512)
    except cpu_groups.Unavailable as why:
        pytest.skip(f"no cpu cgroup here: {why}")
    try:
        shares = group / cpu_groups.weight_file(group.parent, 512)[0]
        assert shares.read_text().strip() in ("512", "50")
        # The way scripts/test joins: the subshell writes its own pid, then execs.
        sleeper = subprocess.Popen(
            ["bash", "-c", f'echo "$BASHPID" > {group}/cgroup.procs && exec sleep 60']
        )
        try:
            own = Path(f"/proc/{sleeper.pid}/cgroup")
            wait_for(lambda: f":/{group.name}\n" in own.read_text(), timeout_s=5,
                     what="the process in the group")  # fmt: skip
            assert cpu_groups.down(group) == [sleeper.pid]
            assert not group.exists()
            assert f":/{group.name}\n" not in own.read_text()
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        if group.exists():
            cpu_groups.down(group)
