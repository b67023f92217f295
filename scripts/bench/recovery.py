#!/usr/bin/env python3
"""Recovery time with a hot spare: node kill -> first completed step at the same world size.

Each run starts a standalone store and 3 + 1 `slurmft agent run` on localhost (gloo, the example
training script), waits for step 8, SIGKILLs one training node (agent, torchrun and workers),
and times the first step that completes afterwards (world size 3 again: the spare joined).
Steps are timestamped as rank 0 appends them to losses.jsonl, polled every 10 ms.

    .venv/bin/python scripts/bench/recovery.py [--runs 5]

The last line is `recovery spare_median_s=X`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The localhost agent cluster is the one the integration tests use.
sys.path[:0] = [str(REPO / "tests" / "integration" / "agent"), str(REPO / "tests")]

from agent_cluster import AgentCluster  # noqa: E402

ARGS = ["--steps", "400", "--ckpt-every", "5", "--work-ms", "100", "--heartbeat-interval-s", "1",
        "--pg-timeout-s", "30"]


class StepClock:
    """Timestamps each line rank 0 appends to losses.jsonl."""

    def __init__(self, path: Path):
        self.path = path
        self.seen: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while not self._stop.wait(0.01):
            if not self.path.exists():
                continue
            with self.path.open() as stream:
                stream.seek(offset)
                chunk = stream.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            now = time.time()
            self.seen += [(now, json.loads(line)) for line in complete.splitlines() if line]

    def first_step_after(self, since: float, world_size: int) -> float | None:
        for seen_at, record in list(self.seen):
            if seen_at > since and record["world_size"] == world_size:
                return seen_at
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one_run(root: Path, timeout_s: float, settings: list[str], env: dict[str, str]) -> float:
    cluster = AgentCluster(root, 3, ARGS, settings=settings, env=env)
    clock = StepClock(cluster.out_dir / "losses.jsonl")
    try:
        cluster.start(4)
        cluster.wait_for_step(8, timeout_s)
        active = cluster.active_agents()
        killed_at = cluster.kill_node(active[1])
        (root / "killed_at").write_text(f"{killed_at} agent{active[1].index}\n")
        # +0.5 s: a line written in the instant of the kill belongs to the old world.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            first = clock.first_step_after(killed_at + 0.5, 3)
            if first is not None:
                return first - killed_at
            time.sleep(0.05)
        raise RuntimeError(f"no step within {timeout_s} s of the kill\n{cluster.logs_tail()}")
    finally:
        clock.stop()
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=180)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an agent setting, e.g. agent.keep_alive_max_attempts=3")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory and "
                        "log torchrun at INFO (rendezvous rounds), to see where the time goes")
    args = parser.parse_args()
    env = {"LOGLEVEL": "INFO"} if args.keep else {}
    times = []
    for n in range(args.runs):
        root = Path(tempfile.mkdtemp(prefix="recovery-"))
        try:
            times.append(one_run(root, args.timeout_s, args.set, env))
        finally:
            if args.keep:
                print(f"kept {root}", flush=True)
            else:
                shutil.rmtree(root, ignore_errors=True)
        print(f"run {n + 1}: node kill -> first step at world size 3: {times[-1]:.2f} s",
              flush=True)
    print(f"min {min(times):.2f} s, max {max(times):.2f} s over {len(times)} runs")
    print(f"recovery spare_median_s={statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
