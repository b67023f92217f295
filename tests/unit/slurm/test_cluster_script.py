"""The pure parts of scripts/slurm-cluster (a stdlib-only script, loaded here as a module)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "slurm-cluster"


def load_script(monkeypatch: pytest.MonkeyPatch, **env: str) -> ModuleType:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    loader = importlib.machinery.SourceFileLoader("slurm_cluster_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    monkeypatch.delitem(sys.modules, loader.name, raising=False)
    return module


def test_config_has_the_measured_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script(monkeypatch, SLURMFT_CLUSTER_ROOT="/tmp/slurmft-unit")
    conf = script.render_conf(["n1", "n2", "n3"])
    for line in (
        "SlurmdTimeout=5",
        "MessageTimeout=2",
        "AuthInfo=socket=/tmp/slurmft-unit/munge/munge.socket,cred_expire=5",
        "SlurmdSpoolDir=/tmp/slurmft-unit/spool/%n",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "ProctrackType=proctrack/linuxproc",
        "PartitionName=debug Nodes=n1,n2,n3 Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
        # Jobs in `urgent` preempt those in `debug`, which end PREEMPTED (--requeue ignored).
        "PartitionName=urgent Nodes=n1,n2,n3 MaxTime=INFINITE State=UP PriorityTier=2",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=CANCEL",
    ):
        assert line in conf.splitlines()
    port = script.base_port()
    assert f"NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port={port + 3}" in conf


def test_ports_differ_between_roots(monkeypatch: pytest.MonkeyPatch) -> None:
    default = load_script(monkeypatch, SLURMFT_CLUSTER_ROOT="/tmp/slurmft-cluster")
    assert default.base_port() == 17000
    other = load_script(monkeypatch, SLURMFT_CLUSTER_ROOT="/tmp/slurmft-elsewhere")
    assert other.base_port() != 17000
    assert other.base_port() % 32 == 17032 % 32  # blocks of 32 ports never overlap
    pinned = load_script(monkeypatch, SLURMFT_CLUSTER_PORT="23000")
    assert pinned.base_port() == 23000


def test_a_cluster_keeps_the_port_it_was_brought_up_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`up` again, `revive` or `kill-node` without SLURMFT_CLUSTER_PORT keep a pinned port (the
    suite pins one per worker cluster; the derived one would move it onto another's)."""
    pinned = load_script(
        monkeypatch, SLURMFT_CLUSTER_ROOT=str(tmp_path), SLURMFT_CLUSTER_PORT="23000"
    )
    pinned.CONF.parent.mkdir(parents=True)
    pinned.CONF.write_text(pinned.render_conf(["n1"]))
    monkeypatch.delenv("SLURMFT_CLUSTER_PORT")
    again = load_script(monkeypatch)
    assert again.base_port() == 23000
    assert again.render_conf(["n1"]) == pinned.CONF.read_text()


@pytest.mark.parametrize(
    ("value", "names"), [("3", ["n1", "n2", "n3"]), ("gpu-a, gpu-b", ["gpu-a", "gpu-b"])]
)
def test_node_names(monkeypatch: pytest.MonkeyPatch, value: str, names: list[str]) -> None:
    assert load_script(monkeypatch, SLURMFT_CLUSTER_NODES=value).node_names() == names


@pytest.mark.parametrize("value", ["0", "n1;id", "40", ","])
def test_bad_node_names(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    script = load_script(monkeypatch, SLURMFT_CLUSTER_NODES=value)
    with pytest.raises(script.ClusterError):
        script.node_names()


def test_export_line_is_shell_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script(monkeypatch, SLURMFT_CLUSTER_ROOT="/tmp/a dir")
    assert script.export_line() == "export SLURM_CONF='/tmp/a dir/etc/slurm.conf'"
