"""A training script for the environment tests: each worker records what it runs in (its
interpreter, two variables, its mount and pid namespaces, its job, attempt and GPUs), then trains as
slurmft.train.examples.tiny does, with the same arguments."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out-dir") + 1])
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "executable": sys.executable,
        "mark": os.environ.get("SLURMFT_E2E_MARK"),
        "from_setup": os.environ.get("SLURMFT_E2E_SETUP"),
        "mnt": os.readlink("/proc/self/ns/mnt"),
        "pid": os.readlink("/proc/self/ns/pid"),
        "node": os.environ.get("SLURMD_NODENAME"),
        "rank": os.environ.get("RANK"),
        "job": os.environ.get("SLURM_JOB_ID"),
        "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
        "gpus": os.environ.get("SLURM_GPUS_ON_NODE"),
    }
    with (out / "identity.jsonl").open("a") as log:
        log.write(json.dumps(record) + "\n")
    runpy.run_module("slurmft.train.examples.tiny", run_name="__main__")


if __name__ == "__main__":
    main()
