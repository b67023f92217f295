#!/usr/bin/env python3
"""How fast the daemon finds a hung rank and a straggler, end to end on the local Slurm cluster.

Each trial submits the example training run (slurmft.train.examples.tiny, 3 nodes + 1 spare)
with `slurmft submit` to the real `slurmft daemon` (SQLite store), waits until it trains, then:

- hang: SIGSTOPs the worker process of rank 1 (its heartbeats stop while its peers', blocked in
  the all-reduce, still arrive: the frozen rank only the daemon can see; the peers' collective
  timeout and step deadline are set past the daemon's silent_after_s so they do not end it
  first). hang_declared_s: the stop -> the daemon's hang event for rank 1 in the store;
  hang_recovered_s: the stop -> the first step rank 0 completes in the restarted world (the
  daemon told the node's agent to restart its workers; they resume from the last checkpoint).
- straggler: a run whose rank 1 computes 30% slower from step K (--slow-factor,
  --slow-from-step). straggler_steps: steps rank 0 completed after K until the daemon's
  straggler event for rank 1 is in the store (the in-process detector's own report, sent by an
  agent, is printed beside it).

Steps are timestamped as rank 0 appends them to losses.jsonl (polled every 10 ms); events as the
store records them. Medians over --trials; the last line is

    detect hang_declared_s=X hang_recovered_s=Y straggler_steps=Z

Uses the cluster at $SLURMFT_CLUSTER_ROOT (default /tmp/bench-cluster): started (and stopped at
the end) if it is not running. Run as root: .venv/bin/python scripts/bench/detect.py [--trials 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm-cluster"
# The Slurm end-to-end tests' helpers: the daemon process, `slurmft submit`, the cluster's undo.
sys.path[:0] = [str(REPO / "tests" / "integration" / "slurm"), str(REPO / "tests")]

from daemon_process import DaemonProcess, running_daemon  # noqa: E402
from e2e_run import SubmittedRun, submit  # noqa: E402
from local_cluster import Cluster  # noqa: E402
from recovery import StepClock  # noqa: E402
from support.processes import workers  # noqa: E402

from slurmft.db.models import Event, EventKind  # noqa: E402
from slurmft.slurm.cli_backend import CliSlurmClient  # noqa: E402

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]
FAULT_RANK = 1
STALL_STEP = 40  # --hang stall: well after the run is seen training (step 10)
POLL_S = 0.1
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    poll_interval_s: float
    silent_after_s: float
    straggler_window_s: float
    straggler_threshold: float
    work_ms: float
    heartbeat_interval_s: float
    slow_factor: float
    slow_from_step: int
    timeout_s: float
    keep: bool = False  # each trial's directory: job log, losses, the run's events

    @property
    def patience_s(self) -> float:
        """The peers' collective timeout and step deadline: well past the daemon's verdict."""
        return max(60.0, 4 * self.silent_after_s)

    def daemon_env(self) -> dict[str, str]:
        return {
            "SLURMFT_DAEMON_POLL_INTERVAL_S": f"{self.poll_interval_s:g}",
            "SLURMFT_POLICY_SILENT_AFTER_S": f"{self.silent_after_s:g}",
            "SLURMFT_POLICY_STRAGGLER_WINDOW_S": f"{self.straggler_window_s:g}",
            "SLURMFT_POLICY_STRAGGLER_THRESHOLD": f"{self.straggler_threshold:g}",
        }

    def script(self, *extra: str) -> list[str]:
        return [
            *EXAMPLE,
            *("--steps", "100000", "--ckpt-every", "5", "--work-ms", f"{self.work_ms:g}"),
            *("--heartbeat-interval-s", f"{self.heartbeat_interval_s:g}"),
            *(
                "--pg-timeout-s",
                f"{self.patience_s:g}",
                "--step-deadline-s",
                f"{self.patience_s:g}",
            ),
            *extra,
        ]

    def describe(self) -> str:
        return (
            f"daemon: poll {self.poll_interval_s:g} s, silent_after {self.silent_after_s:g} s, "
            f"straggler window {self.straggler_window_s:g} s threshold "
            f"{self.straggler_threshold:g}; agents: defaults (report every 1 s); training: "
            f"tiny 3 nodes + 1 spare, 1 rank each, work {self.work_ms:g} ms/step, heartbeat "
            f"{self.heartbeat_interval_s:g} s, step deadline and collective timeout "
            f"{self.patience_s:g} s; straggler: rank {FAULT_RANK} +{self.slow_factor:.0%} from "
            f"step {self.slow_from_step}"
        )


def until(what: str, probe: Callable[[], T | None], timeout_s: float) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


# --- the cluster and one submitted run -----------------------------------------------------------


def cluster_script(*args: str) -> str:
    done = subprocess.run(
        [str(CLUSTER_SCRIPT), *args], check=True, capture_output=True, text=True, timeout=300
    )
    return done.stdout


@contextmanager
def slurm_cluster(keep: bool) -> Iterator[Path]:
    """The cluster at $SLURMFT_CLUSTER_ROOT: used if it runs, else started and later stopped."""
    root = Path(os.environ.setdefault("SLURMFT_CLUSTER_ROOT", "/tmp/bench-cluster"))
    running = "slurmctld: pid -" not in cluster_script("status")
    if not running:
        cluster_script("up")
    os.environ["SLURM_CONF"] = str(root / "etc" / "slurm.conf")
    print(f"cluster {root}: {'in use already' if running else 'started'}", file=sys.stderr)
    try:
        yield Path(os.environ["SLURM_CONF"])
    finally:
        if not running and not keep:
            cluster_script("down")


@contextmanager
def submitted(
    daemon: DaemonProcess, slurm_conf: Path, settings: Settings, name: str, *extra: str
) -> Iterator[tuple[SubmittedRun, StepClock]]:
    """A run training under the daemon, in its own directory; cancelled afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix=f"detect-{name}-"))
    tmp.chmod(0o777)
    cluster = Cluster(CliSlurmClient(slurm_conf=str(slurm_conf), timeout_s=20), slurm_conf, tmp)
    clock: StepClock | None = None
    try:
        run = submit(cluster, daemon, tmp, settings.script(*extra), name=name)
        clock = StepClock(run.out / "losses.jsonl")
        run.wait_training(past_step=10)
        yield run, clock
    finally:
        if clock is not None:
            clock.stop()
        cluster.undo()  # cancels the job, waits for every node idle
        if settings.keep:
            print(f"  kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def worker_pid(run: SubmittedRun, rank: int) -> int:
    """The training process of ``rank`` (torchrun sets RANK in the workers' environment only)."""
    for pid, _argv, environ in workers("slurmft.train.examples.tiny", str(run.out).encode()):
        if f"RANK={rank}".encode() in environ:
            return pid
    raise LookupError(f"no worker process of rank {rank} for {run.out}")


def first_event(run: SubmittedRun, kind: EventKind, since: float, **where: object) -> Event | None:
    for event in run.events(Event.kind == kind):
        if event.recorded_at.timestamp() >= since and all(
            getattr(event, key) == value for key, value in where.items()
        ):
            return event
    return None


# --- the trials ----------------------------------------------------------------------------------


def hang_trial(daemon: DaemonProcess, slurm_conf: Path, settings: Settings) -> tuple[float, float]:
    with submitted(daemon, slurm_conf, settings, "hang") as (run, clock):
        pid = worker_pid(run, FAULT_RANK)
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        try:
            event = until(
                "hang event for the stopped rank",
                lambda: first_event(
                    run, EventKind.HANG, stopped_at, rank=FAULT_RANK, source="daemon"
                ),
                settings.timeout_s,
            )
            declared = event.recorded_at.timestamp() - stopped_at
            print(f"  hang declared: {event.message}", file=sys.stderr)
            return declared, training_again(run, clock, stopped_at, settings) - stopped_at
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the stopped worker, if nothing else ended it


def stall_trial(daemon: DaemonProcess, slurm_conf: Path, settings: Settings) -> tuple[float, float]:
    """Rank 1 stops calling collectives after step STALL_STEP (tiny's --hang-at-step); its
    heartbeats go on, overdue after the step deadline, set to silent_after_s here. The peers
    wait inside the same all-reduce, so they are overdue as soon: the daemon cannot tell them
    apart from the heartbeats it gets. Every hang event is printed with its rank and source."""
    stall = [
        *("--hang-at-step", f"{STALL_STEP}@0", "--fault-rank", str(FAULT_RANK)),
        *("--step-deadline-s", f"{settings.silent_after_s:g}"),
    ]
    with submitted(daemon, slurm_conf, settings, "stall", *stall) as (run, clock):
        stalled_at = until(
            f"step {STALL_STEP}",
            lambda: next((at for at, rec in list(clock.seen) if rec["step"] >= STALL_STEP), None),
            settings.timeout_s,
        )
        event = until(
            "a hang event", lambda: first_event(run, EventKind.HANG, stalled_at), settings.timeout_s
        )
        recovered = training_again(run, clock, stalled_at, settings)
        hangs = [
            f"rank {e.rank} by the {e.source} after {e.recorded_at.timestamp() - stalled_at:.1f} s"
            for e in run.events(Event.kind == EventKind.HANG)
        ]
        print(f"  hang events: {'; '.join(hangs)}", file=sys.stderr)
        return event.recorded_at.timestamp() - stalled_at, recovered - stalled_at


def training_again(
    run: SubmittedRun, clock: StepClock, stopped_at: float, settings: Settings
) -> float:
    """When rank 0 of the restarted world completed its first step: the first step seen after
    rank 0 wrote `resumed` (the old world may still finish a step: the agent lets a stopped
    worker go on for its stack dump before it kills it)."""
    resumed = until(
        "the restarted world's resume from its checkpoint",
        lambda: next(
            (
                e
                for e in run.jsonl("events.jsonl")
                if e.get("event") == "resumed" and e["time"] > stopped_at
            ),
            None,
        ),
        settings.timeout_s,
    )
    again_at, again = until(
        "a step of the restarted world",
        lambda: next(((at, rec) for at, rec in list(clock.seen) if at > resumed["time"]), None),
        settings.timeout_s,
    )
    print(
        f"  rank 0 at step {clock_step(clock, stopped_at)} at the stop; resumed from step "
        f"{resumed['step']} {resumed['time'] - stopped_at:.1f} s after it; step {again['step']} "
        "done",
        file=sys.stderr,
    )
    return again_at


def straggler_trial(
    daemon: DaemonProcess, slurm_conf: Path, settings: Settings
) -> tuple[int, float]:
    """Steps (and seconds) from the slow rank's onset to the daemon's straggler event."""
    slow = [
        *("--slow-rank", str(FAULT_RANK), "--slow-factor", f"{settings.slow_factor:g}"),
        *("--slow-from-step", str(settings.slow_from_step)),
    ]
    with submitted(daemon, slurm_conf, settings, "straggler", *slow) as (run, clock):
        onset = settings.slow_from_step
        onset_at = until(
            f"step {onset}",
            lambda: next((at for at, rec in list(clock.seen) if rec["step"] >= onset), None),
            settings.timeout_s,
        )
        event = until(
            "the daemon's straggler event for the slow rank",
            lambda: first_event(run, EventKind.STRAGGLER, 0, rank=FAULT_RANK, source="daemon"),
            settings.timeout_s,
        )
        flagged_at = event.recorded_at.timestamp()
        steps = clock_step(clock, flagged_at) - onset
        agent = first_event(run, EventKind.STRAGGLER, 0, source="agent")
        in_process = (
            f"step +{clock_step(clock, agent.recorded_at.timestamp()) - onset}" if agent else "none"
        )
        print(
            f"  straggler: {event.message} (the in-process detector's report, through an agent: "
            f"{in_process})",
            file=sys.stderr,
        )
        return steps, flagged_at - onset_at


def clock_step(clock: StepClock, at: float) -> int:
    """The newest step rank 0 had completed at ``at`` (0 before the first)."""
    return max((rec["step"] for seen, rec in list(clock.seen) if seen <= at), default=0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3, help="trials of each kind (median)")
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="daemon poll")
    parser.add_argument("--silent-after-s", type=float, default=10.0, help="policy.silent_after_s")
    parser.add_argument("--straggler-window-s", type=float, default=30.0)
    parser.add_argument("--straggler-threshold", type=float, default=0.2)
    parser.add_argument("--work-ms", type=float, default=150.0, help="simulated compute per step")
    parser.add_argument("--slow-factor", type=float, default=0.3)
    parser.add_argument("--slow-from-step", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per awaited outcome")
    parser.add_argument("--only", choices=("hang", "straggler"), help="run one kind of trial")
    parser.add_argument(
        "--hang",
        choices=("sigstop", "stall"),
        default="sigstop",
        help="sigstop: rank 1's worker frozen (the daemon's own case: no heartbeats); stall: "
        "rank 1 stops calling collectives (tiny --hang-at-step), heartbeats go on and turn "
        "overdue; the first hang event of any rank and source counts",
    )
    parser.add_argument("--keep-cluster", action="store_true", help="leave a started cluster up")
    parser.add_argument("--keep", action="store_true", help="keep each trial's directory")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    settings = Settings(
        poll_interval_s=args.poll_interval_s,
        silent_after_s=args.silent_after_s,
        straggler_window_s=args.straggler_window_s,
        straggler_threshold=args.straggler_threshold,
        work_ms=args.work_ms,
        heartbeat_interval_s=1.0,
        slow_factor=args.slow_factor,
        slow_from_step=args.slow_from_step,
        timeout_s=args.timeout_s,
        keep=args.keep,
    )
    print(f"settings: {settings.describe()}")
    hangs: list[tuple[float, float]] = []
    stragglers: list[tuple[int, float]] = []
    state = Path(tempfile.mkdtemp(prefix="detect-daemon-"))
    try:
        with (
            slurm_cluster(args.keep_cluster) as conf,
            running_daemon(state, **settings.daemon_env()) as daemon,
        ):
            for trial in range(1, args.trials + 1):
                if args.only != "straggler":
                    trial_of = stall_trial if args.hang == "stall" else hang_trial
                    hangs.append(trial_of(daemon, conf, settings))
                    print(f"trial {trial}: hang declared {hangs[-1][0]:.1f} s, training again "
                          f"{hangs[-1][1]:.1f} s after the stop", flush=True)  # fmt: skip
                if args.only != "hang":
                    stragglers.append(straggler_trial(daemon, conf, settings))
                    steps, seconds = stragglers[-1]
                    print(f"trial {trial}: straggler flagged {steps} steps ({seconds:.1f} s) "
                          f"after the onset", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(state, ignore_errors=True)
    declared = statistics.median(h[0] for h in hangs) if hangs else float("nan")
    recovered = statistics.median(h[1] for h in hangs) if hangs else float("nan")
    steps = statistics.median(s[0] for s in stragglers) if stragglers else float("nan")
    if stragglers:
        seconds = statistics.median(s[1] for s in stragglers)
        print(f"straggler onset -> flagged: median {seconds:.1f} s")
    print(f"detect hang_declared_s={declared:.1f} hang_recovered_s={recovered:.1f} "
          f"straggler_steps={steps:g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
