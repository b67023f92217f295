"""A Slurm cluster of a test module's own: `scripts/slurm-cluster` under a fresh root, for tests
that need another size than the suite's six-node cluster. Each root gets its own ports and
munged, so it runs beside the suite's clusters (one per xdist worker)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm-cluster"


# Ports for the clusters tests start themselves: a block of 32 per cluster (slurmctld, then one
# per node), OWN_PORTS_PER_SLOT of those per xdist worker and one slot more for a run without
# xdist, all below Linux's ephemeral range (32768-60999). The root-derived default port of
# scripts/slurm-cluster may collide between two random roots; pinned ports never do.
OWN_PORT_BASE = 18000
OWN_PORTS_PER_SLOT = 10 * 32
MAX_WORKERS = 16  # scripts/test allows SLURMFT_TEST_WORKERS up to this
_started = itertools.count()


def xdist_worker_index() -> int | None:
    """This process's pytest-xdist worker number (gwN -> N), None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return None if worker is None else int(worker.removeprefix("gw"))


def worker_slot() -> int:
    """The worker's number; a run without xdist takes the slot after the last worker's."""
    index = xdist_worker_index()
    return MAX_WORKERS if index is None else index


def own_cluster_port() -> int:
    return OWN_PORT_BASE + worker_slot() * OWN_PORTS_PER_SLOT + (next(_started) % 10) * 32


@dataclass(frozen=True)
class OwnCluster:
    root: str
    conf: str  # its slurm.conf: SLURM_CONF for the Slurm commands


@contextmanager
def own_cluster(nodes: int, *, prefix: str, root: str | None = None) -> Iterator[OwnCluster]:
    """Up with `nodes` nodes under `root` (default: a fresh short directory, since munge and
    slurmd sockets live under it); down and removed afterwards."""
    root = root or tempfile.mkdtemp(prefix=prefix)
    Path(root).mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # munged runs as its own user
    env = {
        **os.environ,
        "SLURMFT_CLUSTER_ROOT": root,
        "SLURMFT_CLUSTER_NODES": str(nodes),
        "SLURMFT_CLUSTER_PORT": str(own_cluster_port()),
    }
    env.pop("SLURM_CONF", None)  # the suite's cluster is not this one
    up = [str(CLUSTER_SCRIPT), "up"]
    done = subprocess.run(up, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    try:
        yield OwnCluster(root, done.stdout.strip().split("=", 1)[1])
    finally:
        down = [str(CLUSTER_SCRIPT), "down"]
        subprocess.run(down, env=env, capture_output=True, timeout=120, check=False)
        shutil.rmtree(root, ignore_errors=True)
