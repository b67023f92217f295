"""Recovery on a local Slurm cluster of the benchmark's own, under the daemon (recovery.py's
default): what a user sees after `slurmft submit`, measured from the loss of a node to the first
step completed at the full world size again.

Each run submits the example (`slurmft submit`, 3 nodes, 100 ms steps, a durable checkpoint
every 5) and, once it trained 8 steps, loses an active node that is not the batch host:
- spare: the node is killed (slurmd, step daemons and every process under them, as
  `scripts/slurm-cluster kill-node`); the job holds one warm spare, which takes over;
- requeue: the same kill, with no spare: the job is requeued without the node;
- freeze: the node is frozen whole (SIGSTOP, as `scripts/slurm-cluster freeze-node`; a hung
  kernel or a lost NIC sends nothing, closes nothing), with a spare. After the recovery it is
  thawed: its processes must all end (its agent fenced, exit 6; or stopped first, when the
  daemon or Slurm called the node lost while it was frozen) with no restart of the others.
The breakdown (seconds after the loss) comes from the store: the survivors' first report of the
failure (a rank's failure or a peer declared dead), the first agent joining a new rendezvous
round, the daemon's record of the lost node, the attempt started by the requeue; and from the
example's own journal: when rank 0 of the new workers had loaded the checkpoint or snapshot
(`workers_resumed`: the round, the workers' start, the process group and the load are behind).

`--code REV` runs slurmft from a git worktree of REV (the daemon, `slurmft submit`, the agents
and the script, through PYTHONPATH; the benchmark's own harness stays this checkout's), and
`--write-baseline` records its medians in recovery-baseline.json: the `ratio` printed later is
the spare median over the baseline's requeue median, so slowing the requeue path cannot improve
it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests" / "integration" / "slurm"), str(REPO / "tests")]

from daemon_process import DaemonProcess, running_daemon  # noqa: E402
from e2e_run import SubmittedRun, run_processes_on, submit  # noqa: E402
from local_cluster import Cluster  # noqa: E402
from slurm_clusters import CLUSTER_SCRIPT, own_cluster  # noqa: E402
from step_clock import StepClock  # noqa: E402
from support.waiting import WaitTimeout, wait_for_value  # noqa: E402

from slurmft.db.models import Event, EventKind  # noqa: E402
from slurmft.slurm.cli_backend import CliSlurmClient  # noqa: E402

BASELINE = Path(__file__).with_name("recovery-baseline.json")
MODES = ("spare", "requeue", "freeze")
NODES = 3
# Room for every mode's runs without reviving a node in between: a killed node is revived after
# its run, but Slurm keeps a requeued job off it only while it is excluded.
CLUSTER_NODES = 8
SCRIPT = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}",
          "--steps", "2000", "--ckpt-every", "5", "--work-ms", "100",
          "--heartbeat-interval-s", "1", "--pg-timeout-s", "30"]  # fmt: skip
FIRST_FAILURE = (EventKind.RANK_FAILURE, EventKind.COLLECTIVE_ERROR, EventKind.PEER_DEAD)


@dataclass
class Outcome:
    mode: str
    victim: str
    recovery_s: float  # the loss -> the first step at the full world size
    replayed_steps: int
    # The store's timeline, in seconds after the loss (absent: not recorded).
    stages: dict[str, float] = field(default_factory=dict)
    thawed: str | None = None  # freeze: how the thawed node's processes ended


def load_cluster_script(root: str) -> ModuleType:
    """scripts/slurm-cluster as a module, for its node kill and freeze in this process: the
    loss is then timed at the signal, not at a subprocess's start or exit."""
    os.environ["SLURMFT_CLUSTER_ROOT"] = root  # the script reads its root when loaded
    loader = importlib.machinery.SourceFileLoader("slurm_cluster_script", str(CLUSTER_SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _seconds(at: datetime, since: float) -> float:
    aware = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    return aware.timestamp() - since


def stages(run: SubmittedRun, lost_at: float, victim: str) -> dict[str, float]:
    """The store's timeline of one recovery, seconds after the loss."""
    since = datetime.fromtimestamp(lost_at - 1, UTC)
    events = run.events(Event.occurred_at >= since)
    found: dict[str, float] = {}

    def first(name: str, *kinds: EventKind, node: str | None = None) -> None:
        times = [
            _seconds(e.occurred_at, lost_at)
            for e in events
            if e.kind in kinds and (node is None or e.node == node)
        ]
        if times:
            found[name] = min(times)

    first("failure_seen", *FIRST_FAILURE)
    first("peer_declared_dead", EventKind.PEER_DEAD)
    first("daemon_node_lost", EventKind.NODE_LOST, node=victim)
    first("round_joined", EventKind.RESTART)
    # Rank 0 of the new workers loaded the checkpoint (or snapshot): the round, the workers'
    # start, the process group and the load are behind.
    resumed = [e["time"] for e in run.jsonl("events.jsonl") if e["event"] == "resumed"]
    if [t for t in resumed if t > lost_at]:
        found["workers_resumed"] = min(t for t in resumed if t > lost_at) - lost_at
    started = [a.started_at for a in run.attempts() if a.number > 1 and a.started_at is not None]
    if started:
        found["requeued_job_running"] = _seconds(min(started), lost_at)
    return found


def beating_nodes(run: SubmittedRun, job_nodes: list[str]) -> dict[int, str]:
    ranks, _ = wait_for_value(
        "every rank beating from the job's nodes",
        run.beating_nodes,
        lambda ranks: len(ranks) == NODES and set(ranks.values()) <= set(job_nodes),
        timeout_s=60,
    )
    return ranks


def after_thaw(run: SubmittedRun, node: str, thawed_at: float) -> str:
    """How the thawed node's processes ended, and whether the others restarted meanwhile."""
    try:
        _, seconds = wait_for_value(
            f"every process of the run on {node} gone", lambda: run_processes_on(run, node),
            lambda pids: not pids, timeout_s=30,
        )  # fmt: skip
    except WaitTimeout:
        return f"processes still running on {node} 30 s after the thaw"
    since = datetime.fromtimestamp(thawed_at, UTC)
    fenced = run.events(Event.kind == EventKind.FENCED, Event.node == node)
    restarts = run.events(Event.kind == EventKind.RESTART, Event.occurred_at >= since)
    how = "fenced (exit 6)" if fenced else "stopped before it could fence itself"
    return f"gone {seconds:.1f} s after the thaw, {how}; restarts since: {len(restarts)}"


def one_run(bench: Bench, mode: str, index: int, timeout_s: float) -> Outcome:
    where = bench.root / f"{mode}-{index}"
    where.mkdir()
    where.chmod(0o777)
    cluster = Cluster(bench.client, Path(bench.conf), where)
    run = submit(
        cluster, bench.daemon, where, bench.script_args, name=f"bench-{mode}-{index}", nodes=NODES,
        spares=0 if mode == "requeue" else 1, env=bench.job_env,
    )  # fmt: skip
    clock = StepClock(run.out / "losses.jsonl")
    try:
        wait_for_value(
            "step 8 at the full world size",
            lambda: clock.last_step_before(time.time()),
            lambda step: step >= 8,
            timeout_s=timeout_s,
        )
        job = bench.client.job(run.job_id)
        ranks = beating_nodes(run, list(job.nodes))
        victim = sorted(set(ranks.values()) - {job.batch_host})[0]
        if mode == "freeze":
            cluster._frozen.add(victim)  # thawed by the undo whatever happens
            bench.script.freeze(victim)
        else:
            cluster._killed.add(victim)  # revived by the undo
            bench.script.hard_kill(bench.script.node_processes(victim))
        lost_at = time.time()
        # +0.5 s: a line written in the instant of the loss belongs to the old world.
        (seen_at, record), _ = wait_for_value(
            f"a step at world size {NODES} after the loss of {victim}",
            lambda: clock.first_step_after(lost_at + 0.5, NODES),
            bool,
            timeout_s=timeout_s,
        )
        outcome = Outcome(
            mode, victim, seen_at - lost_at,
            max(0, clock.last_step_before(lost_at) - record["step"] + 1),
        )  # fmt: skip
        if mode == "freeze":
            thawed_at = time.time()
            cluster.thaw_node(victim)
            cluster._drained.add(victim)  # Slurm may have called it DOWN meanwhile
            outcome.thawed = after_thaw(run, victim, thawed_at)
        outcome.stages = stages(run, lost_at, victim)
        return outcome
    finally:
        clock.stop()
        cluster.undo()
        run.database.dispose()


@dataclass
class Bench:
    root: Path
    conf: str
    client: CliSlurmClient
    daemon: DaemonProcess
    script: ModuleType
    job_env: dict[str, str]
    script_args: list[str]


@contextmanager
def code_at(rev: str | None, root: Path) -> Iterator[tuple[dict[str, str], str]]:
    """The environment that runs slurmft from ``rev`` (a detached worktree), and the commit."""
    if rev is None:
        yield {}, _git("rev-parse", "--short", "HEAD")
        return
    tree = root / "code"
    _git("worktree", "add", "--detach", str(tree), rev)
    try:
        yield {"PYTHONPATH": str(tree)}, _git("rev-parse", "--short", rev)
    finally:
        _git("worktree", "remove", "--force", str(tree))


def _git(*argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *argv], check=True, capture_output=True, text=True
    ).stdout.strip()


def print_outcome(n: int, outcome: Outcome) -> None:
    parts = ", ".join(f"{name} {value:.2f}" for name, value in sorted(
        outcome.stages.items(), key=lambda item: item[1]))  # fmt: skip
    fence = "" if outcome.thawed is None else f"; thawed: {outcome.thawed}"
    print(
        f"run {n} {outcome.mode} ({outcome.victim}): first step at world size {NODES} after "
        f"{outcome.recovery_s:.2f} s, {outcome.replayed_steps} steps replayed; store (s after "
        f"the loss): {parts or '-'}{fence}",
        flush=True,
    )


def summary(outcomes: dict[str, list[Outcome]], baseline: dict | None) -> dict[str, float]:
    medians: dict[str, float] = {}
    if outcomes.get("spare"):
        medians["spare_median_s"] = statistics.median(o.recovery_s for o in outcomes["spare"])
    if outcomes.get("requeue"):
        medians["requeue_median_s"] = statistics.median(o.recovery_s for o in outcomes["requeue"])
    if baseline and "spare_median_s" in medians:
        medians["ratio"] = medians["spare_median_s"] / baseline["requeue_median_s"]
    every = [o for found in outcomes.values() for o in found]
    medians["replayed_steps_median"] = statistics.median(o.replayed_steps for o in every)
    if outcomes.get("freeze"):
        freeze = outcomes["freeze"]
        detect = [
            o.stages["peer_declared_dead"] for o in freeze if "peer_declared_dead" in o.stages
        ]
        if detect:
            medians["freeze_detect_median_s"] = statistics.median(detect)
        medians["freeze_median_s"] = statistics.median(o.recovery_s for o in freeze)
    return medians


def print_breakdown(outcomes: dict[str, list[Outcome]]) -> None:
    for mode, found in outcomes.items():
        times = [o.recovery_s for o in found]
        print(f"{mode}: min {min(times):.2f} s, max {max(times):.2f} s over {len(times)} runs")
        names = sorted({name for o in found for name in o.stages})
        for name in names:
            values = [o.stages[name] for o in found if name in o.stages]
            print(f"  {name}: median {statistics.median(values):.2f} s ({len(values)} runs)")


def main(
    runs: int, modes: list[str], timeout_s: float, *, code: str | None, write_baseline: bool,
    snapshots: bool, settings: dict[str, str], keep: bool = False,
) -> None:  # fmt: skip
    if os.geteuid() != 0:
        sys.exit("the local Slurm cluster needs root")
    # Stopped (timeout, kill): the cluster, the daemon and the jobs go down on the way out.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    root = Path(tempfile.mkdtemp(prefix="sftbench-"))
    root.chmod(0o755)
    # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: jobs
    # submitted from the checkout would import its slurmft, whatever --code says.
    os.chdir(root)
    baseline = None if write_baseline or not BASELINE.exists() else json.loads(BASELINE.read_text())
    outcomes: dict[str, list[Outcome]] = {mode: [] for mode in modes}
    with (
        code_at(code, root) as (code_env, commit),
        own_cluster(CLUSTER_NODES, prefix="sftbc-", root=str(root / "cluster")) as own,
    ):
        os.environ.update(code_env)
        os.environ["SLURM_CONF"] = own.conf
        client = CliSlurmClient(slurm_conf=own.conf, timeout_s=20)
        with running_daemon(root, SLURMFT_SLURM_CONF=own.conf) as daemon:
            bench = Bench(
                root, own.conf, client, daemon, load_cluster_script(own.root),
                job_env=code_env | settings,
                script_args=[*SCRIPT, "--snapshots"] if snapshots else SCRIPT,
            )  # fmt: skip
            print(f"slurmft at {commit}; cluster {own.root}; daemon log {root / 'daemon.log'}",
                  flush=True)  # fmt: skip
            for n in range(1, runs + 1):
                for mode in modes:  # alternating, so a change of load hits every mode alike
                    outcome = one_run(bench, mode, n, timeout_s)
                    outcomes[mode].append(outcome)
                    print_outcome(n, outcome)
    if keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    print_breakdown(outcomes)
    medians = summary(outcomes, baseline)
    if write_baseline:
        BASELINE.write_text(json.dumps({
            "commit": commit,
            "measured": datetime.now(UTC).isoformat(timespec="seconds"),
            "runs": runs,
            **{k: round(v, 2) for k, v in medians.items()},
            "recovery_s": {m: [round(o.recovery_s, 2) for o in found]
                           for m, found in outcomes.items()},
        }, indent=2) + "\n")  # fmt: skip
        print(f"baseline written to {BASELINE}")
    elif baseline is not None:
        print(f"ratio: against the requeue median {baseline['requeue_median_s']} s measured at "
              f"{baseline['commit']}")  # fmt: skip
    print("recovery " + " ".join(
        f"{k}={v:.2f}" if k != "replayed_steps_median" else f"{k}={v:g}"
        for k, v in medians.items()
    ))  # fmt: skip
