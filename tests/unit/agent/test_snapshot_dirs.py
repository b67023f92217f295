"""The agent's snapshot folder (slurmft.agent.snapshot_dirs): held by a lock for the agent's
life, so a later agent removes the folders of agents that died without removing theirs, and
never a live agent's, another user's, or a lockless folder still in use."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from slurmft.agent.snapshot_dirs import (
    LOCK_NAME,
    LOCKLESS_AFTER_S,
    HeldSnapshotDir,
    SnapshotDirBusy,
    folder_prefix,
    sweep_orphans,
)

UID = os.getuid()

# An agent in a process of its own: holds its folder, says so, then waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from slurmft.agent.snapshot_dirs import HeldSnapshotDir
HeldSnapshotDir(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def agent_folder(parent: Path, name: str) -> Path:
    return parent / f"{folder_prefix(UID)}{name}"


def holder(path: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    return process


def locked(folder: Path) -> bool:
    """Whether a live process holds ``folder``'s lock (flock: per open file, so this process's
    own lock counts too)."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_killed_agents_folder_is_swept_and_a_live_agents_is_not(tmp_path: Path) -> None:
    dead, live = agent_folder(tmp_path, "dead"), agent_folder(tmp_path, "live")
    killed = holder(dead)
    (dead / "step-000000004.pt").write_bytes(b"x" * 1024)
    alive = holder(live)
    try:
        killed.kill()  # SIGKILL: no chance to remove its folder
        killed.wait(timeout=30)
        assert dead.is_dir()
        assert sweep_orphans(tmp_path, UID) == [dead]
        assert not dead.exists() and live.is_dir()
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert sweep_orphans(tmp_path, UID) == [live]


def test_held_and_released_in_process(tmp_path: Path) -> None:
    mine = agent_folder(tmp_path, "mine")
    held = HeldSnapshotDir(mine)
    assert held.acquire() == mine and mine.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == [mine.name]  # no hidden folder left behind
    assert sweep_orphans(tmp_path, UID) == []  # the lock is held by an open descriptor here
    with pytest.raises(SnapshotDirBusy):
        HeldSnapshotDir(mine).acquire()
    held.release()
    assert not mine.exists()


def test_an_earlier_agent_of_the_same_work_dir_that_died_leaves_room(tmp_path: Path) -> None:
    mine = agent_folder(tmp_path, "step-3")
    killed = holder(mine)
    killed.kill()
    killed.wait(timeout=30)
    held = HeldSnapshotDir(mine)
    held.acquire()
    assert mine.is_dir() and not list(mine.glob("step-*"))
    held.release()


def test_lockless_folders_go_only_when_idle_and_other_users_folders_never(tmp_path: Path) -> None:
    fresh, idle = agent_folder(tmp_path, "fresh"), agent_folder(tmp_path, "idle")
    fresh.mkdir()
    idle.mkdir()
    then = time.time() - LOCKLESS_AFTER_S - 1
    os.utime(idle, (then, then))
    other = tmp_path / f"{folder_prefix(UID + 1)}theirs"
    other.mkdir()
    assert sweep_orphans(tmp_path, UID) == [idle]
    assert fresh.is_dir() and other.is_dir()
    if UID == 0:  # a folder with this user's name that someone else owns is not touched
        spoofed = agent_folder(tmp_path, "spoofed")
        spoofed.mkdir()
        os.utime(spoofed, (then, then))
        os.chown(spoofed, 12345, 12345)
        assert sweep_orphans(tmp_path, UID) == []
        assert spoofed.is_dir()


def test_a_link_in_the_folders_place_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("keep")
    agent_folder(tmp_path, "link").symlink_to(target)
    assert sweep_orphans(tmp_path, UID) == []
    assert (target / "precious").read_text() == "keep"


def test_an_agent_sweeps_at_its_start_holds_its_folder_for_its_life_and_removes_it(
    tmp_path: Path,
) -> None:
    """The agent's own wiring (`NodeAgent.run`): a dead agent's folder beside its own goes
    before anything else runs, a live agent's stays, its own is held (locked) while it runs,
    and removed when it ends, here by a preflight that fails."""
    from slurmft.agent.agent import AgentSettings, NodeAgent
    from slurmft.agent.command import TorchrunSpec
    from slurmft.agent.exits import AgentExit
    from slurmft.agent.probe import NoGpuProbe

    spec = TorchrunSpec(nodes=1, nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", rdzv_id="r",
                        script=("/nonexistent/train.py",))  # fmt: skip
    settings = AgentSettings(spec=spec, node="n1", run_id="r",
                             work_dir=tmp_path / f"w{uuid.uuid4().hex[:12]}",
                             controller_url="http://127.0.0.1:9")  # fmt: skip
    node = NodeAgent(settings, NoGpuProbe())
    node.reporter = None  # nothing to report to
    mine = settings.snapshot_dir
    tag = uuid.uuid4().hex[:12]
    dead = agent_folder(mine.parent, f"dead-{tag}")
    live = agent_folder(mine.parent, f"live-{tag}")
    killed, alive = holder(dead), holder(live)
    killed.kill()
    killed.wait(timeout=30)
    seen: dict[str, bool] = {}

    def preflight() -> bool:
        seen["dead swept"] = not dead.exists()
        seen["live kept"] = live.is_dir()
        seen["mine held"] = mine.is_dir() and locked(mine)
        return False

    node.preflight = preflight  # type: ignore[method-assign]
    try:
        assert node.run() is AgentExit.PREFLIGHT_FAILED
    finally:
        alive.kill()
        alive.wait(timeout=30)
        sweep_orphans(mine.parent, UID)
    assert seen == {"dead swept": True, "live kept": True, "mine held": True}
    assert not mine.exists()
