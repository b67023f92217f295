"""An Xid 79 on an active node of a running job (injected through the GPU probe, the way a real
driver reports it to the node's agent): the daemon drains the node in Slurm with the Xid in the
reason, denylists it, the agent leaves, a spare takes over at the same world size, and the run
completes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_process import DaemonProcess, daemon_env, slurmft
from local_cluster import Cluster, wait_for
from sqlalchemy import select

from slurmft.controller.rpc import call
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind, RankHeartbeat
from slurmft.db.records import denied_nodes

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

TINY = [
    "--steps",
    "60",
    "--ckpt-every",
    "5",
    "--work-ms",
    "150",
    "--heartbeat-interval-s",
    "1",
    "--pg-timeout-s",
    "30",
]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    env = daemon_env(tmp_path)
    slurmft(env, "db", "upgrade")
    process = DaemonProcess(env, tmp_path / "daemon.log")
    process.start()
    yield process
    process.stop_if_running()


def _losses(out: Path) -> list[dict[str, Any]]:
    path = out / "losses.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _nodes_by_rank(database: Database, run_id: str) -> dict[int, str]:
    with database.session() as s:
        rows = s.scalars(select(RankHeartbeat).where(RankHeartbeat.run_id == run_id)).all()
        return {hb.rank: hb.node for hb in rows}


def test_xid_79_drains_the_node_and_a_spare_takes_over(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    inject = shared / "gpu-faults"
    inject.write_text("")
    spec = tmp_path / "run.toml"
    script = [
        "-m",
        "slurmft.train.examples.tiny",
        "--ckpt-dir",
        str(shared / "ckpt"),
        "--out-dir",
        str(shared / "out"),
        *TINY,
    ]
    spec.write_text(
        f'name = "xid79"\nnodes = 3\nspares = 1\nckpt_dir = "{shared / "ckpt"}"\n'
        f'script = {json.dumps(script)}\n[env]\nSLURMFT_GPU_INJECT = "{inject}"\n'
        'SLURMFT_GPU_POLL_INTERVAL_S = "1"\n'
    )
    submitted = json.loads(slurmft(daemon.env, "submit", "--spec", str(spec), "--json"))
    run_id, job_id = submitted["run_id"], submitted["job_id"]
    cluster._jobs.append(job_id)
    database = Database(f"sqlite:///{daemon.env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")

    wait_for(
        "training, reported by three ranks",
        lambda: _nodes_by_rank(database, run_id),
        lambda ranks: len(ranks) == 3 and any(r["step"] >= 10 for r in _losses(shared / "out")),
        timeout_s=180,
    )
    batch_host = cluster.client.job(job_id).batch_host
    victim = sorted(set(_nodes_by_rank(database, run_id).values()) - {batch_host})[0]
    cluster._drained.add(victim)  # resumed by the fixture whatever happens
    inject.write_text(f"xid=79,gpu=3,node={victim}\n")

    reason = "slurmft: Xid 79 GPU fell off the bus (GPU 3)"
    wait_for(
        "the drain in Slurm",
        lambda: cluster.client.node(victim),
        lambda node: node.status.drain_requested,
        timeout_s=60,
    )
    assert cluster.client.node(victim).reason.startswith(reason)
    wait_for(
        "a spare to train in its place",
        lambda: _nodes_by_rank(database, run_id),
        lambda ranks: victim not in ranks.values() and len(ranks) == 3,
        timeout_s=120,
    )
    later = call(
        daemon.socket_path,
        "create_run",
        spec={
            "name": "later",
            "nodes": 1,
            "script": ["train.py"],
            "ckpt_dir": str(shared / "later"),
        },
    )
    assert victim in later["exclude"]  # every later submission (and requeue) excludes it
    with database.session() as s:
        assert victim in denied_nodes(s)
        (event,) = s.scalars(select(Event).where(Event.kind == EventKind.GPU_FAULT)).all()
        assert (event.node, event.xid, event.gpu_index) == (victim, 79, 3)
        kinds = {a.kind: a for a in s.scalars(select(Action).where(Action.node == victim))}
        assert kinds[ActionKind.DRAIN_NODE].status is ActionStatus.DONE
        assert kinds[ActionKind.AGENT_LEAVE].reason.startswith(reason)
    wait_for(
        "the run to complete",
        lambda: _losses(shared / "out"),
        lambda records: any(r["step"] == 60 for r in records),
        timeout_s=240,
    )
    assert {r["world_size"] for r in _losses(shared / "out")} == {3}
    database.dispose()


def test_xid_13_restarts_the_run_and_the_node_stays(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    inject = shared / "gpu-faults"
    inject.write_text("")
    spec = tmp_path / "run.toml"
    script = [
        "-m",
        "slurmft.train.examples.tiny",
        "--ckpt-dir",
        str(shared / "ckpt"),
        "--out-dir",
        str(shared / "out"),
        *TINY,
    ]
    spec.write_text(
        f'name = "xid13"\nnodes = 3\nspares = 1\nckpt_dir = "{shared / "ckpt"}"\n'
        f'script = {json.dumps(script)}\n[env]\nSLURMFT_GPU_INJECT = "{inject}"\n'
        'SLURMFT_GPU_POLL_INTERVAL_S = "1"\n'
    )
    submitted = json.loads(slurmft(daemon.env, "submit", "--spec", str(spec), "--json"))
    run_id, job_id = submitted["run_id"], submitted["job_id"]
    cluster._jobs.append(job_id)
    database = Database(f"sqlite:///{daemon.env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    wait_for(
        "training, reported by three ranks",
        lambda: _nodes_by_rank(database, run_id),
        lambda ranks: len(ranks) == 3 and any(r["step"] >= 10 for r in _losses(shared / "out")),
        timeout_s=180,
    )
    node = sorted(set(_nodes_by_rank(database, run_id).values()))[0]
    inject.write_text(f"xid=13,gpu=0,node={node}\n")

    def restarts() -> list[Event]:
        # Every agent re-rendezvouses when one restarts its workers; the restarted node may
        # then wait as the spare, so look for a restart anywhere in the run.
        with database.session() as s:
            query = select(Event).where(Event.kind == EventKind.RESTART, Event.run_id == run_id)
            return list(s.scalars(query).all())

    wait_for(f"the workers to restart after the Xid 13 on {node}", restarts, bool, timeout_s=120)
    wait_for(
        "the run to complete",
        lambda: _losses(shared / "out"),
        lambda records: any(r["step"] == 60 for r in records),
        timeout_s=240,
    )
    assert not cluster.client.node(node).status.drain_requested  # the node stays
    with database.session() as s:
        assert node not in denied_nodes(s, run_id=run_id)
        (event,) = s.scalars(select(Event).where(Event.kind == EventKind.GPU_FAULT)).all()
        assert (event.node, event.xid) == (node, 13)
        (action,) = s.scalars(select(Action).where(Action.node == node)).all()
        assert (action.kind, action.status) == (ActionKind.RESTART_WORKERS, ActionStatus.DONE)
    assert {r["world_size"] for r in _losses(shared / "out")} == {3}
    database.dispose()
