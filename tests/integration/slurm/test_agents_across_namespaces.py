"""Agents on another host reach a daemon started with the shipped `systemd/slurmft.toml`.

The shipped file binds ingest to 0.0.0.0:8787 and tells agents, in [agent] controller_url, the
login node's name. An agent in a network namespace of its own (its own address, the daemon's
host reachable only over a veth pair, the login node's name resolving there to the host side,
as a compute node's /etc/hosts or DNS would) posts to the URL the daemon handed its run. Handed
the wildcard bind, `http://0.0.0.0:8787`, as before, it would post to its own host and fail.

Only the namespace's two addresses (10.213.N.1 and .2, a /30 that exists only on the veth pair)
and this machine's loopback carry traffic; the namespace, the veth and /etc/netns/<name> are
removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_process import run_slurmft
from support.waiting import wait_for_value

from slurmft.controller.rpc import SOCKET_NAME, call

# The shipped file's fixed ports (8787, 9787): these tests run one after another on one worker.
pytestmark = pytest.mark.xdist_group("shipped-config-ports")

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "systemd" / "slurmft.toml"
LOGIN_NAME = "login1.cluster"  # the shipped file's agent.controller_url host


@dataclass(frozen=True)
class Namespace:
    name: str
    host_address: str  # this machine's side of the veth pair
    own_address: str  # the namespace's


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@pytest.fixture
def agent_namespace() -> Iterator[Namespace]:
    tag = uuid.uuid4().hex[:6]
    subnet = 1 + int(tag, 16) % 250
    ns = Namespace(f"sftag{tag}", f"10.213.{subnet}.1", f"10.213.{subnet}.2")
    host_end, ns_end = f"sfth{tag}", f"sftn{tag}"
    etc = Path("/etc/netns") / ns.name
    made_etc_netns = not etc.parent.exists()
    try:
        _ip("netns", "add", ns.name)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns.name)
        _ip("addr", "add", f"{ns.host_address}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns.name, "addr", "add", f"{ns.own_address}/30", "dev", ns_end)
        _ip("-n", ns.name, "link", "set", ns_end, "up")
        _ip("-n", ns.name, "link", "set", "lo", "up")
        # `ip netns exec` bind-mounts /etc/netns/<name>/hosts over /etc/hosts for the command.
        etc.mkdir(parents=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{ns.host_address} {LOGIN_NAME} login1\n")
        yield ns
    finally:
        for undo in (["link", "del", host_end], ["netns", "del", ns.name]):
            subprocess.run(["ip", *undo], capture_output=True, timeout=30, check=False)
        shutil.rmtree(etc if not made_etc_netns else etc.parent, ignore_errors=True)


def _shipped_daemon_env(tmp_path: Path) -> dict[str, str]:
    """The shipped file as it is; only the paths are this test's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    return base | {
        "SLURMFT_CONFIG": str(SHIPPED),
        "SLURMFT_PATHS_STATE_DIR": str(tmp_path / "state"),
        "SLURMFT_PATHS_RUNTIME_DIR": str(tmp_path / "run"),
    }


# What an agent does first (the clock check) and then all the time (a batch of reports), with
# the agent's own HTTP client.
AGENT = textwrap.dedent(
    """
    import json, sys, time
    from slurmft.agent.reporter import HttpTransport
    from slurmft.protocol import AgentBatch, RankHeartbeat
    url, token, run_id = sys.argv[1:4]
    transport = HttpTransport(url, token, timeout_s=5.0)
    now = time.time()
    beat = RankHeartbeat(rank=0, local_rank=0, phase="step", step=7, progress_age_s=0.1,
                         deadline_s=300.0, overdue=False, sent_at=now)
    batch = AgentBatch(run_id=run_id, agent_id="a-ns-1", node="n1", seq=1, sent_at=now,
                       heartbeats=(beat,))
    reply = transport.send_batch(batch)
    print(json.dumps({"acked_seq": reply.acked_seq}))
    """
)


@pytest.mark.netns
@pytest.mark.slurm  # the daemon lists the nodes' addresses at start
def test_an_agent_on_another_host_reaches_the_daemon_of_the_shipped_config(
    agent_namespace: Namespace, tmp_path: Path
) -> None:
    env = _shipped_daemon_env(tmp_path)
    assert run_slurmft(env, "db", "upgrade").returncode == 0
    log = tmp_path / "daemon.log"
    with log.open("ab") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "slurmft", "daemon"], env=env, stdout=out, stderr=out
        )
    socket_path = tmp_path / "run" / SOCKET_NAME
    try:
        wait_for_value("the daemon's socket", socket_path.exists, bool, timeout_s=30)
        spec = {"name": "ns", "nodes": 1, "script": ["train.py"], "ckpt_dir": str(tmp_path)}
        created = call(socket_path, "create_run", spec=spec)
        assert created["controller_url"] == f"http://{LOGIN_NAME}:8787", log.read_text()
        agent = subprocess.run(
            ["ip", "netns", "exec", agent_namespace.name, sys.executable, "-c", AGENT,
             created["controller_url"], created["token"], created["run_id"]],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert agent.returncode == 0, f"{agent.stderr}\n{log.read_text()}"
        assert json.loads(agent.stdout.splitlines()[-1]) == {"acked_seq": 1}
        with sqlite3.connect(tmp_path / "state" / "slurmft.db") as db:
            stored = db.execute(
                "SELECT step, node FROM rank_heartbeats WHERE run_id = ?", (created["run_id"],)
            ).fetchall()
        assert stored == [(7, "n1")]
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def test_a_daemon_handing_agents_a_wildcard_address_refuses_to_start(tmp_path: Path) -> None:
    env = _shipped_daemon_env(tmp_path) | {"SLURMFT_DAEMON_AGENTS_URL": "http://0.0.0.0:8787"}
    assert run_slurmft(env, "db", "upgrade").returncode == 0
    done = run_slurmft(env, "daemon")
    assert done.returncode != 0
    assert "names no host" in done.stderr and "daemon.agents_url" in done.stderr, done.stderr
