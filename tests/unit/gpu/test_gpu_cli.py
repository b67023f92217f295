"""`slurmft gpu status [--json]` as a user runs it (in-process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.cli import run_cli


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith("SLURMFT_") and not name.startswith("SLURMFT_TEST_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURMFT_PATHS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SLURMFT_GPU_DCGM", "false")  # a developer machine may have DCGM
    return tmp_path


def test_status_json_without_gpu_says_why_and_exits_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(capsys, "gpu", "status", "--json")
    assert code == 0, err
    data = json.loads(out)
    if data["gpu_present"]:
        pytest.skip("this machine has an NVIDIA GPU")
    assert data["no_gpu_reason"] == "no NVIDIA driver on this node (libnvidia-ml.so.1 not found)"
    assert data["faults"] == [] and data["drain_reason"] is None and data["action"] == "record"
    assert {s["source"]: s["status"] for s in data["sources"]}["nvml"] == "no_gpu"


def test_status_json_shows_injected_faults_and_their_classification(
    capsys: pytest.CaptureFixture[str], isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = isolated_env / "inject"
    faults.write_text("xid=79,gpu=3\nxid=13,gpu=0\n{\"kind\": \"ecc_uncorrected\", \"gpu\": 1}\n"
                      "xid=4242,gpu=2\n")
    monkeypatch.setenv("SLURMFT_GPU_INJECT", str(faults))
    code, out, err = run_cli(capsys, "gpu", "status", "--json")
    assert code == 0, err
    data = json.loads(out)
    injected = [f for f in data["faults"] if f["source"] == "inject"]
    assert [(f["xid"], f["gpu"], f["action"], f["fault_class"]) for f in injected] == [
        (79, 3, "drain", "hardware"),
        (13, 0, "restart_app", "user_code"),
        (None, 1, "drain", "hardware"),
        (4242, 2, "restart_app", "unknown"),
    ]
    assert injected[0]["drain_reason"] == "slurmft: Xid 79 GPU fell off the bus (GPU 3)"
    assert data["action"] == "drain"
    assert data["drain_reason"] == "slurmft: Xid 79 GPU fell off the bus (GPU 3) (+1 more)"


def test_status_text_names_the_verdict(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMFT_GPU_INJECT", "xid=13,gpu=0")
    code, out, _ = run_cli(capsys, "gpu", "status")
    assert code == 0
    assert "restart_app GPU 0    Xid 13 graphics engine exception  [inject]" in out
    assert out.rstrip().endswith("verdict: restart_app")
    monkeypatch.setenv("SLURMFT_GPU_INJECT", "kind=gpu_lost,gpu=5")
    _, out, _ = run_cli(capsys, "--set", "gpu.dcgm=false", "gpu", "status")
    assert "verdict: drain this node: slurmft: GPU is lost (GPU 5)" in out


def test_gpu_group_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "gpu" in out


def test_since_boot_shows_older_kernel_log_xids(capsys: pytest.CaptureFixture[str],
                                                isolated_env: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    log = isolated_env / "kernel-nvrm.log"  # what a site's root HealthCheckProgram writes
    log.write_text("[   12.500000] NVRM: Xid (PCI:0000:3b:00): 48, pid=7, DBE\n")
    monkeypatch.setenv("SLURMFT_GPU_KERNEL_LOG_FILE", str(log))
    _, out, _ = run_cli(capsys, "gpu", "status", "--json")
    assert json.loads(out)["faults"] == []  # 12.5 s after boot is before this probe started
    _, out, _ = run_cli(capsys, "gpu", "status", "--json", "--since-boot")
    (fault,) = json.loads(out)["faults"]
    assert (fault["xid"], fault["pci_bus"], fault["source"]) == (48, "0000:3b:00", "file")
