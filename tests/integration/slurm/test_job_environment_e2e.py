"""The job's environment, explicit (issue 15): a run submitted with a setup line, an `--env`
variable, `--python` pointing at a second venv, the agents inside a bubblewrap container, one
`--sbatch-arg` and one `--srun-arg`, trains in that venv and that container, on every node and
again after a node is killed; a wrong `--python` is refused before sbatch."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, run_slurmft
from e2e_run import IDENTITY_TRAIN, TINY, second_venv, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

SCRIPT = [IDENTITY_TRAIN, "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", *TINY]


def bwrap_wrapper(hosts: Path) -> str:
    """Everything read-only but /tmp (the checkpoints, the outputs, the cluster's spool), pid
    and UTS namespaces of its own, nothing left behind if the agent's srun task dies.

    The hostname is the node's, as on a real cluster: every node of the local cluster is this
    one host, and torchrun names a rendezvous member by hostname and pid, which a fresh pid
    namespace makes the same on every node (their members collided, and no round completed;
    measured). So each node has its own hostname, resolved by an /etc/hosts of the test's."""
    bwrap = ("exec bwrap --unshare-pid --unshare-uts --hostname \"$SLURMD_NODENAME\" "
             f"--die-with-parent --ro-bind / / --ro-bind {hosts} /etc/hosts --dev /dev "
             '--proc /proc --bind /tmp /tmp "$@"')  # fmt: skip
    return shlex.join(["sh", "-c", bwrap, "bwrap"])


def hosts_file(where: Path, cluster: Cluster) -> Path:
    """A loopback address of each node's own (127.0.0.0/8 is this host's), so that its name
    and the name its address resolves back to are the node's (torchrun's member name is
    `getfqdn()`, which for a shared 127.0.0.1 is `localhost` on every node)."""
    lines = ["127.0.0.1 localhost"]
    lines += [f"127.0.0.{10 + i} {name}" for i, name in enumerate(sorted(cluster.client.nodes()))]
    where.write_text("\n".join(lines) + "\n")
    return where


def test_setup_env_python_and_a_container_reach_every_worker_before_and_after_a_node_loss(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    python = second_venv(tmp_path / "venv2")
    run = submit(
        cluster, daemon, tmp_path, SCRIPT, name="environment",
        env={"SLURMFT_E2E_MARK": "from --env"},
        fields={
            "python": str(python),
            "setup": ["export SLURMFT_E2E_SETUP=from-setup"],
            "container_wrapper": bwrap_wrapper(hosts_file(tmp_path / "hosts", cluster)),
            "sbatch_args": ["--mail-type=END"],
            "srun_args": ["--job-name=slurmft-agents"],
        },
    )  # fmt: skip
    run.wait_training()
    job = subprocess.run(["scontrol", "-o", "show", "job", run.job_id], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert "MailType=END" in job, job
    steps = subprocess.run(["scontrol", "-o", "show", "step", run.job_id], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    assert "Name=slurmft-agents" in steps, steps

    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
    before = len(run.jsonl("identity.jsonl"))
    cluster.kill_node(victim)
    run.wait_replaced(victim)
    wait_for_value("the run to complete", lambda: run.run().state,
                   lambda state: state is RunState.COMPLETED, timeout_s=240)  # fmt: skip

    records = run.jsonl("identity.jsonl")
    assert len(records) > before >= 3, records  # workers started again after the loss
    host = {"mnt": os.readlink("/proc/self/ns/mnt"), "pid": os.readlink("/proc/self/ns/pid")}
    for record in records:
        assert record["executable"] == str(python), record
        assert (record["mark"], record["from_setup"]) == ("from --env", "from-setup"), record
        assert record["mnt"] != host["mnt"] and record["pid"] != host["pid"], record
    after = {r["node"] for r in records[before:]}
    assert victim not in after and len(after) == 3, records[before:]
    run.database.dispose()


def test_a_wrong_python_is_refused_before_sbatch(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    argv = ["submit", "--nodes", "1", "--spares", "0", "--ckpt-dir", str(ckpt), "--json"]
    missing = run_slurmft(daemon.env, *argv, "--python", str(tmp_path / "nope" / "python"),
                          "--", IDENTITY_TRAIN)  # fmt: skip
    assert missing.returncode == 2 and "no such interpreter" in missing.stderr, missing.stderr
    bare = run_slurmft({**daemon.env, "PYTHONPATH": ""}, *argv, "--python", "/usr/bin/python3",
                       "--", IDENTITY_TRAIN)  # fmt: skip
    assert bare.returncode == 2 and "cannot import slurmft.train and torch" in bare.stderr
    assert "pip install" in bare.stderr, bare.stderr
    assert not ckpt.exists()  # refused before the run's folder, the daemon or sbatch
    listed = json.loads(run_slurmft(daemon.env, "runs", "--json").stdout or "[]")
    assert listed == [] or all(r.get("name") != IDENTITY_TRAIN for r in listed)
