#!/usr/bin/env python3
"""Recovery time: a node lost -> first completed step at the full world size again.

By default (`--on slurm`, as root) on a local Slurm cluster of its own under the daemon, through
`slurmft submit`: spare, requeue and freeze runs alternating (scripts/bench/recovery_slurm.py
says how each is measured), with the breakdown the store records. The last line is

    recovery spare_median_s=.. requeue_median_s=.. ratio=.. replayed_steps_median=..
    freeze_detect_median_s=.. freeze_median_s=..

`ratio` is the spare median over the requeue median measured at the parent commit of the
recovery work (recovery-baseline.json, written by `--code REV --write-baseline`).

    .venv/bin/python scripts/bench/recovery.py [--runs 5] [--mode spare,requeue,freeze]
    .venv/bin/python scripts/bench/recovery.py --code d91428d --write-baseline

`--on localhost` runs 3 + 1 `slurmft agent run` by hand instead (a standalone store, no Slurm,
no daemon; quicker to iterate on): each run waits for step 8, then loses one training node:
- kill: SIGKILL of the node's agent, torchrun, zygote and workers (the kernel closes their
  sockets, so the survivors' workers fail at once);
- freeze: SIGSTOP of all of them, as a hung node or a lost network sends nothing; its detection
  is the first survivor's "declared dead" line, and the node is thawed after the recovery (it
  must then be fenced: its agent exits 6).
Steps are timestamped as rank 0 appends them to losses.jsonl, polled every 10 ms; replayed steps
are those trained again after the recovery (the last step before the loss minus the first step
after it, plus one).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The localhost agent cluster is the one the integration tests use.
sys.path[:0] = [str(REPO / "tests" / "integration" / "agent"), str(REPO / "tests")]

from agent_cluster import AgentCluster  # noqa: E402
from step_clock import StepClock  # noqa: E402

from slurmft.agent.exits import AgentExit  # noqa: E402
from slurmft.agent.procs import descendants, signal_pids  # noqa: E402

ARGS = ["--steps", "400", "--ckpt-every", "5", "--work-ms", "100", "--heartbeat-interval-s", "1",
        "--pg-timeout-s", "30"]


@dataclass
class Outcome:
    recovery_s: float
    replayed_steps: int
    detect_s: float | None = None  # freeze mode: until a survivor declared the node dead


def replayed(records: list[dict], old_attempt: int) -> int:
    before = [r["step"] for r in records if r["attempt"] == old_attempt]
    after = [r["step"] for r in records if r["attempt"] != old_attempt]
    return max(0, max(before) - min(after) + 1) if before and after else 0


def declared_at(cluster: AgentCluster, since: float, deadline: float) -> float | None:
    while time.monotonic() < deadline:
        if any("declared dead and evicted" in agent.log() for agent in cluster.agents):
            return time.time() - since
        time.sleep(0.01)
    return None


def one_run(
    root: Path, timeout_s: float, settings: list[str], env: dict[str, str], *, mode: str,
    script_args: list[str],
) -> Outcome:
    cluster = AgentCluster(root, 3, script_args, settings=settings, env=env)
    clock = StepClock(cluster.out_dir / "losses.jsonl")
    try:
        cluster.start(4)
        cluster.wait_for_step(8, timeout_s)
        victim = cluster.active_agents()[1]
        old_attempt = cluster.records()[-1]["attempt"]
        node = [victim.process.pid, *descendants(victim.process.pid)]
        if mode == "kill":
            lost_at = cluster.kill_node(victim)
        else:
            signal_pids(node, signal.SIGSTOP)
            lost_at = time.time()
        (root / "lost_at").write_text(f"{lost_at} {mode} agent{victim.index}\n")
        deadline = time.monotonic() + timeout_s
        detect_s = declared_at(cluster, lost_at, deadline) if mode == "freeze" else None
        # +0.5 s: a line written in the instant of the loss belongs to the old world.
        while time.monotonic() < deadline:
            seen = clock.first_step_after(lost_at + 0.5, 3)
            if seen is not None:
                first = seen[0]
                if mode == "freeze":
                    signal_pids(node, signal.SIGCONT)
                    code = victim.process.wait(timeout=30)
                    if code != AgentExit.FENCED:
                        raise RuntimeError(f"the thawed node's agent exited {code}, not fenced")
                return Outcome(first - lost_at, replayed(cluster.records(), old_attempt), detect_s)
            time.sleep(0.05)
        raise RuntimeError(f"no step within {timeout_s} s of the loss\n{cluster.logs_tail()}")
    finally:
        clock.stop()
        cluster.stop()


def on_localhost(args: argparse.Namespace) -> None:
    env = {"LOGLEVEL": "INFO"} if args.keep else {}
    if args.mode in ("both", "all"):
        modes = ["kill", "freeze"]
    else:
        modes = ["kill" if mode == "spare" else mode for mode in args.mode.split(",")]
    if set(modes) - {"kill", "freeze"}:
        sys.exit(f"--on localhost runs kill and freeze, not {args.mode}")
    outcomes: dict[str, list[Outcome]] = {mode: [] for mode in modes}
    for n in range(args.runs):
        for mode in modes:  # alternating, so a change of load hits both alike
            root = Path(tempfile.mkdtemp(prefix="recovery-"))
            try:
                script_args = [*ARGS, "--snapshots"] if args.snapshots else ARGS
                outcome = one_run(root, args.timeout_s, args.set, env, mode=mode,
                                  script_args=script_args)
            finally:
                if args.keep:
                    print(f"kept {root}", flush=True)
                else:
                    shutil.rmtree(root, ignore_errors=True)
            outcomes[mode].append(outcome)
            detected = "" if outcome.detect_s is None else f", declared at {outcome.detect_s:.2f} s"
            print(f"run {n + 1} {mode}: first step at world size 3 after {outcome.recovery_s:.2f} s"
                  f"{detected}, {outcome.replayed_steps} steps replayed", flush=True)
    fields = []
    for mode, found in outcomes.items():
        times = [o.recovery_s for o in found]
        print(f"{mode}: min {min(times):.2f} s, max {max(times):.2f} s over {len(times)} runs")
    if "kill" in outcomes:
        kill_median = statistics.median(o.recovery_s for o in outcomes["kill"])
        fields.append(f"spare_median_s={kill_median:.2f}")
    every = [o for found in outcomes.values() for o in found]
    fields.append(f"replayed_steps_median={statistics.median(o.replayed_steps for o in every):g}")
    if "freeze" in outcomes:
        freeze = outcomes["freeze"]
        detect = [o.detect_s for o in freeze if o.detect_s is not None]
        if detect:
            fields.append(f"freeze_detect_median_s={statistics.median(detect):.2f}")
        fields.append(f"freeze_median_s={statistics.median(o.recovery_s for o in freeze):.2f}")
    print("recovery " + " ".join(fields))


def on_slurm(args: argparse.Namespace) -> None:
    import recovery_slurm

    if args.mode in ("all", "both"):
        modes = list(recovery_slurm.MODES)
    else:
        modes = ["spare" if mode == "kill" else mode for mode in args.mode.split(",")]
    unknown = set(modes) - set(recovery_slurm.MODES)
    if unknown:
        sys.exit(f"no mode {', '.join(sorted(unknown))} on slurm: {recovery_slurm.MODES}")
    settings = {}
    for item in args.set:
        key, _, value = item.partition("=")
        settings["SLURMFT_" + key.upper().replace(".", "_")] = value
    recovery_slurm.main(
        args.runs, modes, args.timeout_s, code=args.code, write_baseline=args.write_baseline,
        snapshots=args.snapshots, settings=settings, keep=args.keep,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--on", choices=["slurm", "localhost"], default="slurm",
                        help="a local Slurm cluster of its own with the daemon (root), or agents "
                        "started by hand on localhost (no Slurm, no daemon)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=180)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an agent setting, e.g. agent.keep_alive_max_attempts=3")
    parser.add_argument("--mode", default="all",
                        help="slurm: spare, requeue, freeze, a comma list, or all; "
                        "localhost: kill, freeze or all")
    parser.add_argument("--snapshots", action="store_true",
                        help="the script takes in-memory snapshots (K from their cost)")
    parser.add_argument("--code", metavar="REV",
                        help="slurm: run slurmft from a worktree of this commit (a baseline)")
    parser.add_argument("--write-baseline", action="store_true",
                        help="slurm: record the medians as the baseline the ratio is taken "
                        "against (scripts/bench/recovery-baseline.json)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (and "
                        "the daemon's log); localhost: log torchrun at INFO (rendezvous rounds)")
    args = parser.parse_args()
    if args.on == "localhost":
        on_localhost(args)
    else:
        on_slurm(args)


if __name__ == "__main__":
    main()
