"""The pure parts of scripts/slurm-cluster (a stdlib-only script, loaded here as a module)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from support.processes import argv_of

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


# A process that starts a child in a process group of its own, in its session (as a batch
# script's bash starts srun), and waits. The child exits when it gets SIGHUP, leaving a mark.
TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], process_group=0)
time.sleep(120)
"""
HUP_MARKED = """
import pathlib, signal, subprocess, sys, time
mark = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGHUP, lambda *_: (mark.write_text("woken by SIGHUP"), sys.exit(0)))
subprocess.Popen(["sleep", "120"])
time.sleep(120)
"""


def _started_tree(script: ModuleType, mark: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The parent, then its child and grandchild once they are all there."""
    parent = subprocess.Popen(
        [sys.executable, "-c", TREE, HUP_MARKED, str(mark)], start_new_session=True
    )
    deadline = time.monotonic() + 30
    while len(script.with_descendants({parent.pid})) < 3:
        assert time.monotonic() < deadline, "the process tree did not start"
        time.sleep(0.05)
    tree = script.children_by_parent()
    (child,) = tree[parent.pid]
    (grandchild,) = tree[child]
    return parent, [parent.pid, child, grandchild]


def _gone(pids: list[int]) -> bool:
    return all(not Path(f"/proc/{pid}").exists() for pid in pids)


def _command_line(pid: int) -> list[str] | None:
    try:
        return argv_of(pid)
    except OSError:  # exited
        return None


def test_a_node_kill_kills_children_before_their_parents(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A stopped process whose parent dies first is woken by the kernel (SIGHUP, SIGCONT: its
    process group is orphaned). On a killed batch host that is srun, which then ends its step
    on every other node; a lost host does nothing of the kind. Children first, nothing wakes."""
    script = load_script(monkeypatch, SLURMFT_CLUSTER_ROOT=str(tmp_path))
    mark = tmp_path / "woken"
    parent, (parent_pid, child, grandchild) = _started_tree(script, mark)
    try:
        order = script.children_first({parent_pid, child, grandchild})
        assert order.index(grandchild) < order.index(child) < order.index(parent_pid)
        assert sorted(script.hard_kill({parent_pid})) == sorted([parent_pid, child, grandchild])
        parent.wait(timeout=10)
        assert script.wait_until(lambda: _gone([child, grandchild]), 10, 0.05)
        assert not mark.exists()
    finally:
        # Only while it is ours: once reaped, its pid may be another process's (pid_max 32768).
        if parent.poll() is None:
            script.hard_kill({parent.pid})
            parent.wait(timeout=10)


def test_the_kernel_wakes_a_stopped_child_whose_parent_is_killed_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The rule `children_first` avoids, shown: the parent killed while its child is stopped."""
    script = load_script(monkeypatch, SLURMFT_CLUSTER_ROOT=str(tmp_path))
    mark = tmp_path / "woken"
    parent, (parent_pid, child, grandchild) = _started_tree(script, mark)
    started = {pid: _command_line(pid) for pid in (child, grandchild)}
    try:
        script.stop_tree({child})
        # A process takes its SIGSTOP when it next runs, which on loaded cores is a while later;
        # the kernel wakes only a group that is stopped when the parent dies.
        assert script.wait_until(
            lambda: all(script.process_state(pid) == "T" for pid in (child, grandchild)), 30, 0.05
        ), "the child did not stop"
        os.kill(parent_pid, signal.SIGKILL)
        parent.wait(timeout=10)
        # The child exits only after writing its mark: a mark merely there may still be empty.
        assert script.wait_until(lambda: _gone([child]), 10, 0.05), "the stopped child slept on"
        assert mark.read_text() == "woken by SIGHUP"
    finally:
        # The child exits on SIGHUP; what is left of the tree (the orphaned sleep) goes. Init
        # reaps them, so a pid is killed only while it still runs what it ran: a reaped one may
        # be another test's process by now (pid_max 32768), and hard_kill takes its tree too.
        ours = {pid for pid, line in started.items() if line and _command_line(pid) == line}
        script.hard_kill(ours)
