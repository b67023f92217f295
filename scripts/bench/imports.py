#!/usr/bin/env python3
"""What a start costs: the wall time of `slurmft --version` (every CLI start builds the whole
typer app first) and of importing the node agent and the batch step (each node pays it when a
job starts or relaunches its agent step), each in a fresh process.

Each command runs --runs times (default 10) after one untimed run that warms the page cache and
writes the bytecode. Prints min/median/max wall seconds per command, and the median CPU seconds
(user + system: what load from other processes moves less); the last line is

    imports version_median_s=X agent_median_s=Y batch_step_median_s=Z

The numbers move with the machine's load: compare runs taken at a load average below 1.
`slurmft` is the console script beside this interpreter (the one a user runs), else
`python -m slurmft`. Run: .venv/bin/python scripts/bench/imports.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def slurmft_command() -> list[str]:
    script = Path(sys.executable).with_name("slurmft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "slurmft"]


COMMANDS: dict[str, list[str]] = {
    "version": [*slurmft_command(), "--version"],
    "agent": [sys.executable, "-c", "import slurmft.agent.agent"],
    "batch_step": [sys.executable, "-c", "import slurmft.agent.batch_step"],
}


def environment() -> dict[str, str]:
    """This checkout first on the path, whatever checkout the interpreter's install points at;
    bytecode written and read as an installed slurmft has it (PYTHONDONTWRITEBYTECODE would time
    compiling every changed module at each start)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh process; runs are sequential, so the children's CPU
    total grows by this one's."""
    cpu_before = children_cpu_seconds()
    began = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - began, children_cpu_seconds() - cpu_before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    env = environment()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.runs} fresh processes each")
    medians: dict[str, float] = {}
    for name, argv in COMMANDS.items():
        timed_run(argv, env)  # warm: page cache, bytecode
        runs = [timed_run(argv, env) for _ in range(args.runs)]
        walls = [wall for wall, _ in runs]
        medians[name] = statistics.median(walls)
        cpu = statistics.median(cpu for _, cpu in runs)
        print(
            f"{name:<11} min {min(walls):.3f} s  median {medians[name]:.3f} s  "
            f"max {max(walls):.3f} s  cpu median {cpu:.3f} s   ({' '.join(argv[-2:])})"
        )
    print("imports " + " ".join(f"{name}_median_s={value:.3f}" for name, value in medians.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
