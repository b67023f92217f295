#!/usr/bin/env python3
"""How fast the local Slurm cluster comes up and reacts to a lost node, through slurmft's client.

Measures, on a cluster of its own (SLURMFT_CLUSTER_ROOT, default /tmp/slurmft-bench):
- cluster up: `scripts/slurm-cluster up` from stopped to every node idle (packages present);
- kill -> NOT_RESPONDING and kill -> DOWN: a faithful kill of a non-batch node of a running
  3-node --no-kill job, until `scontrol show node` says so;
- kill batch host -> detected: until `batch_host_down()` reports the job (can be near 0 s: when
  the job's other step daemons end, slurmctld's messages to the dead host are refused at once);
- requeue -> running: `requeue(job, exclude=[node])` until the job runs again without it.
Each is repeated --rounds times; the last line is

    slurm_recovery up_s=.. kill_to_not_responding_s=.. kill_to_down_s=.. ...  (medians)

Run as root: .venv/bin/python scripts/bench/slurm_recovery.py [--rounds 3] [--keep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from slurmft.slurm.api import JobInfo, SubmitRequest
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.script import render_batch_script
from slurmft.slurm.states import JobState

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm-cluster"
POLL_S = 0.1
T = TypeVar("T")


def cluster(*args: str) -> str:
    return subprocess.run([str(CLUSTER), *args], check=True, capture_output=True, text=True).stdout


def seconds_until(
    probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 120
) -> float:
    started = time.monotonic()
    while not done(probe()):
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not done after {timeout_s} s")
        time.sleep(POLL_S)
    return time.monotonic() - started


def running_job(client: CliSlurmClient) -> JobInfo:
    step = ["srun", "--no-kill", "--kill-on-bad-exit=0", "-N3", "-n3", "sleep", "600"]
    job_id = client.submit(
        SubmitRequest(script=render_batch_script(step), job_name="slurmft-bench",
                      run_id="bench", nodes=3, output="/dev/null")
    )  # fmt: skip
    seconds_until(lambda: client.job(job_id).state, lambda s: s is JobState.RUNNING, 60)
    return client.job(job_id)


def wait_all_idle(client: CliSlurmClient) -> None:
    seconds_until(
        lambda: [str(node.status) for node in client.nodes().values()],
        lambda states: all(state == "IDLE" for state in states),
    )


def measure_node_loss(client: CliSlurmClient) -> dict[str, float]:
    job = running_job(client)
    victim = next(node for node in job.nodes if node != job.batch_host)
    killed_at = time.monotonic()
    cluster("kill-node", victim)
    not_responding = seconds_until(lambda: client.node(victim).status, lambda s: s.lost)
    down = seconds_until(lambda: client.node(victim).status, lambda s: s.down)
    down += not_responding
    # The job shrank and runs on; now requeue it without the dead node.
    requeued_at = time.monotonic()
    client.requeue(job.job_id, exclude=[victim])
    seconds_until(
        lambda: client.job(job.job_id),
        lambda j: j.state is JobState.RUNNING and j.restarts == 1 and victim not in j.nodes,
    )
    requeue = time.monotonic() - requeued_at
    loss_to_running = time.monotonic() - killed_at
    cluster("revive", victim)
    batch_detect = measure_batch_host_loss(client, job)
    client.cancel(job.job_id)
    wait_all_idle(client)
    return {
        "kill_to_not_responding_s": not_responding,
        "kill_to_down_s": down,
        "requeue_to_running_s": requeue,
        "kill_to_running_again_s": loss_to_running,
        "kill_batch_host_to_detected_s": batch_detect,
    }


def measure_batch_host_loss(client: CliSlurmClient, job: JobInfo) -> float:
    current = client.job(job.job_id)
    cluster("kill-node", current.batch_host)
    detected = seconds_until(lambda: client.batch_host_down(job.job_id), lambda down: down)
    cluster("revive", current.batch_host)
    return detected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    args = parser.parse_args()
    os.environ.setdefault("SLURMFT_CLUSTER_ROOT", "/tmp/slurmft-bench")
    cluster("down")
    up_times = []
    for _ in range(args.rounds):
        started = time.monotonic()
        export = cluster("up")
        up_times.append(time.monotonic() - started)
        cluster("down")
    cluster("up")
    conf = export.strip().split("=", 1)[1].strip("'")
    client = CliSlurmClient(slurm_conf=conf, timeout_s=20)
    rounds = []
    try:
        for index in range(args.rounds):
            rounds.append(measure_node_loss(client))
            print(
                f"round {index + 1}: " + " ".join(f"{k}={v:.1f}" for k, v in rounds[-1].items()),
                file=sys.stderr,
            )
    finally:
        if not args.keep:
            cluster("down")
    medians = {"up_s": statistics.median(up_times)}
    medians |= {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"cluster up (s): {', '.join(f'{t:.2f}' for t in up_times)}")
    for key in rounds[0]:
        print(f"{key}: {', '.join(f'{r[key]:.1f}' for r in rounds)}")
    print("slurm_recovery " + " ".join(f"{key}={value:.2f}" for key, value in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
