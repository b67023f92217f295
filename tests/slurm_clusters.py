"""A Slurm cluster of a test module's own: `scripts/slurm-cluster` under a fresh root, for tests
that need another size than the suite's six-node cluster. Each root gets its own ports and
munged, so it runs beside the suite's cluster."""

from __future__ import annotations

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
    env = {**os.environ, "SLURMFT_CLUSTER_ROOT": root, "SLURMFT_CLUSTER_NODES": str(nodes)}
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
