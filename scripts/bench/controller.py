#!/usr/bin/env python3
"""One control tick of the daemon for 16,384 simulated ranks: ingest, observe, detect, decide, act.

The store (SQLite by default, --db-url for PostgreSQL) holds runs made like real ones (the
daemon's own create_run and attach_job operations: a run token, a Slurm job) with 2,048 nodes x
8 ranks in all, and the history detection reads: every rank's step times over the straggler
window and its newest heartbeat. Then each tick does what the daemon does in one poll interval:

- ingest: one batch from every agent (a heartbeat per rank, the step times of the steps that
  ended in the interval) through the endpoint's own request handling (check the headers, parse
  the JSON, hand the batch to the group committer and wait for the reply), posted by
  --in-flight request threads at once as the HTTP server's threads would; the committer's
  writer stores what arrives together in one transaction (token, cursor, heartbeats, step
  times, commands). Agents send a batch every agent.report_interval_s (1 s by default), so a
  5-s poll interval really carries five of these per agent;
- observe: `gather` from the store, with the daemon's held straggler window (StepWindows: the
  step times added since the last pass are read, not the whole window; the window is read
  whole once before the first tick, as after a daemon start, and that read is reported), and
  Slurm answered by a fake runner that prints what `squeue` and `sinfo -N` print, parsed by
  the real client (Slurm's own latency is NOT measured here: on a real cluster add two
  command round trips);
- decide: `decide` (it runs the hang and straggler detectors);
- act: `Executor.execute` of the decided actions (store rows; no Slurm call is decided).

The data holds one rank stuck in its step past the deadline, one frozen rank (no heartbeat
for 3 x silent_after_s) and one straggler (30% slower compute in every bucket); the bench
checks on every tick that the detectors find all three, that the first tick decides the hang
events, the restarts and the straggler, that later ticks do not repeat them (they are
recorded), and that the next ingest hands the restart commands (and, with a spare, the
straggler's leave) to the agents.

Reported per phase and in total: process CPU time (time.process_time: the daemon's own work,
store included for SQLite, the PostgreSQL server's not) and wall time, medians over --ticks.
The last line is

    controller ranks=16384 tick_cpu_s=X tick_wall_s=Y ingest_cpu_s=.. observe_cpu_s=.. ...

    .venv/bin/python scripts/bench/controller.py [--ticks 5] [--db-url postgresql://...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from slurmft.config import Config, load_config
from slurmft.controller import views as v
from slurmft.controller.act import Executor
from slurmft.controller.daemon import freeze_long_lived, tune_collector
from slurmft.controller.decide import Policy, decide
from slurmft.controller.detect import HangKind, find_hangs, find_stragglers
from slurmft.controller.group_commit import GroupCommitter
from slurmft.controller.http import _Handler
from slurmft.controller.observe import gather
from slurmft.controller.step_window import StepWindows
from slurmft.controller.user_ops import operations
from slurmft.db import Database
from slurmft.db.ingest import HeartbeatReport, StepTimeReport, record_heartbeats, record_step_times
from slurmft.db.models import Attempt, Event, EventKind, Run, StepTime
from slurmft.protocol import AgentBatch, BatchReply, CommandKind, RankHeartbeat, RankStepTime
from slurmft.slurm import commands
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.hostlist import compress
from slurmft.slurm.runner import CommandResult

PHASES = ("ingest", "observe", "decide", "act")
STEP_DEADLINE_S = 300.0  # slurmft.train's default step deadline
OWNER_UID = 0


@dataclass(frozen=True)
class Shape:
    nodes: int
    ranks_per_node: int
    runs: int
    spares: int
    step_s: float
    tick_s: float
    window_s: float
    silent_after_s: float

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def history_steps(self) -> int:
        """Steps ended before the first tick: a whole straggler window and one more."""
        return int(self.window_s // self.step_s) + 1

    def step_end(self, start: datetime, step: int) -> datetime:
        """Every rank ends step ``history_steps`` at ``start``, one step every ``step_s``."""
        return start + timedelta(seconds=(step - self.history_steps) * self.step_s)

    def steps_between(self, start: datetime, since: datetime, now: datetime) -> range:
        """The steps that end in (since, now]."""

        def last(t: datetime) -> int:
            return self.history_steps + math.floor((t - start).total_seconds() / self.step_s)

        return range(last(since) + 1, last(now) + 1)


@dataclass
class SimRun:
    """One run as its agents see it: the token, the Slurm job, the nodes and their ranks."""

    run_id: str
    token: str
    job_id: str
    nodes: list[str]  # training nodes, in rank order
    spares: list[str]
    ranks_per_node: int
    seq: dict[str, int] = field(default_factory=dict)  # per agent

    def ranks_of(self, node: str) -> range:
        first = self.nodes.index(node) * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


@dataclass(frozen=True)
class Faults:
    """Where the detectors must find something (run 0)."""

    overdue_rank: int
    frozen_rank: int
    straggler_rank: int
    overdue_since: datetime  # no progress since (still heartbeating)
    frozen_since: datetime  # neither progress nor heartbeats since


# --- Slurm, answered in its own output formats ---------------------------------------------------


class FakeSlurm:
    """A Runner that prints what squeue and sinfo -N print for the simulated jobs and nodes,
    so the real CliSlurmClient parses it. Any other command is an error: none is expected."""

    def __init__(self, runs: Sequence[SimRun], extra_idle: int) -> None:
        self.runs = runs
        self.calls: list[str] = []
        busy = [n for r in runs for n in (*r.nodes, *r.spares)]
        idle = [f"x{i:05d}" for i in range(extra_idle)]
        self._sinfo = "".join(f"{n}|allocated|Unknown|Unknown|none\n" for n in busy) + "".join(
            f"{n}|idle|Unknown|Unknown|none\n" for n in idle
        )

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        self.calls.append(argv[0])
        if argv[0] == "squeue":
            wanted = next(a for a in argv if a.startswith("--jobs=")).split("=", 1)[1].split(",")
            assert f"--format={commands.SQUEUE_FORMAT}" in argv
            out = "".join(self._squeue_line(r) for r in self.runs if r.job_id in wanted)
            return CommandResult(tuple(argv), 0, out, "")
        if argv[0] == "sinfo":
            assert f"--format={commands.SINFO_FORMAT}" in argv
            return CommandResult(tuple(argv), 0, self._sinfo, "")
        raise AssertionError(f"unexpected Slurm command in the bench: {list(argv)}")

    @staticmethod
    def _squeue_line(run: SimRun) -> str:
        nodes = compress([*run.nodes, *run.spares])
        return f"{run.job_id}|RUNNING|None|{nodes}|{run.nodes[0]}|slurmft-run:{run.run_id}|bench\n"


# --- the store ---------------------------------------------------------------------------------


def compute_s(rank: int, step: int, faults: Faults | None, base_s: float) -> float:
    """A rank's own compute time: +-3% noise, 30% more for the straggler."""
    noise = 1.0 + 0.03 * ((rank * 7919 + step * 104729) % 201 - 100) / 100
    slow = 1.3 if faults is not None and rank == faults.straggler_rank else 1.0
    return base_s * noise * slow


def create_runs(database: Database, shape: Shape, submitted_at: datetime) -> list[SimRun]:
    """Runs made by the daemon's own operations (what `slurmft submit` calls over the socket),
    dated back to ``submitted_at``: they have been training for a while."""
    ops = operations(database, controller_url="http://bench")
    per_run = shape.nodes // shape.runs
    runs = []
    for index in range(shape.runs):
        first = index * (per_run + shape.spares)
        names = [f"n{first + i:05d}" for i in range(per_run + shape.spares)]
        spec = {
            "name": f"bench{index}",
            "nodes": per_run,
            "spares": shape.spares,
            "nproc_per_node": shape.ranks_per_node,
            "script": ["train.py"],
            "ckpt_dir": "/shared/ckpt",
        }
        created = ops["create_run"](OWNER_UID, {"spec": spec})
        job_id = str(1000 + index)
        ops["attach_job"](OWNER_UID, {"run_id": created["run_id"], "job_id": job_id})
        with database.session() as session:  # submitted before the history begins
            run = session.get(Run, created["run_id"])
            assert run is not None
            run.created_at = run.attempts[-1].submitted_at = submitted_at
        runs.append(
            SimRun(
                created["run_id"],
                created["token"],
                job_id,
                names[:per_run],
                names[per_run:],
                shape.ranks_per_node,
            )
        )
    return runs


def fill_history(
    database: Database, runs: Sequence[SimRun], shape: Shape, start: datetime, faults: Faults
) -> int:
    """Step times over the straggler window and every rank's heartbeat, as if the runs had been
    training for a while; the stuck rank ended no step since it got stuck, the frozen rank
    neither, and its last heartbeat is older than silent_after_s."""
    rows = 0
    steps = shape.history_steps + 1
    for index, run in enumerate(runs):
        sim = faults if index == 0 else None
        ranks = len(run.nodes) * run.ranks_per_node
        with database.session() as session:
            attempt_id = session.scalar(select(Attempt.id).where(Attempt.run_id == run.run_id))
        for chunk in range(0, steps, 10):
            times = [
                StepTimeReport(
                    rank=rank,
                    step=step,
                    compute_s=compute_s(rank, step, sim, shape.step_s * 0.8),
                    wait_s=shape.step_s * 0.1,
                    ended_at=ended,
                )
                for step in range(chunk, min(chunk + 10, steps))
                for rank in range(ranks)
                if (ended := shape.step_end(start, step)) <= stopped(sim, rank, start)
            ]
            with database.session() as session:
                rows += record_step_times(session, run.run_id, attempt_id, times)
        by_last_beat: dict[datetime, list[HeartbeatReport]] = {}
        for rank in range(ranks):
            last = start if sim is None or rank != sim.frozen_rank else sim.frozen_since
            by_last_beat.setdefault(last, []).append(
                HeartbeatReport(
                    rank=rank,
                    node=run.nodes[rank // run.ranks_per_node],
                    phase="step",
                    step=steps,
                    seq=1,
                    sent_at=last,
                    progress_age_s=1.0,
                    deadline_s=STEP_DEADLINE_S,
                )
            )
        for last, beats in by_last_beat.items():
            with database.session() as session:
                record_heartbeats(session, run.run_id, attempt_id, beats, received_at=last)
            rows += len(beats)
    return rows


def stopped(faults: Faults | None, rank: int, start: datetime) -> datetime:
    """When the rank ended its last step (``start`` for a healthy one)."""
    if faults is not None and rank == faults.overdue_rank:
        return faults.overdue_since
    if faults is not None and rank == faults.frozen_rank:
        return faults.frozen_since
    return start


# --- one tick ----------------------------------------------------------------------------------


class EndpointHandler(_Handler):
    """The ingest endpoint's request handler without a socket: the very `_ingest` the HTTP
    server runs (token, length and body checks, parse, the group committer, the reply)."""

    def __init__(self, committer: GroupCommitter) -> None:
        # BaseHTTPRequestHandler.__init__ serves a socket at once: not called on purpose.
        self.committer = committer

    def post(self, token: str, body: bytes) -> bytes:
        self.headers = {  # type: ignore[assignment]
            "Authorization": f"Bearer {token}",
            "Content-Length": str(len(body)),
        }
        self.rfile = io.BytesIO(body)
        return self._ingest()


def agent_batches(
    runs: Sequence[SimRun], shape: Shape, start: datetime, now: datetime, faults: Faults
) -> list[tuple[str, str, bytes]]:
    """(node, token, body) of every agent's report for the interval that ends at ``now``: built
    by the agents, so not measured. The frozen rank sends nothing; the overdue one no progress."""
    steps = shape.steps_between(start, now - timedelta(seconds=shape.tick_s), now)
    bodies = []
    for index, run in enumerate(runs):
        sim = faults if index == 0 else None
        for node in run.nodes:
            run.seq[node] = run.seq.get(node, 0) + 1
            beats, times = [], []
            for rank in run.ranks_of(node):
                if sim is not None and rank == sim.frozen_rank:
                    continue
                stuck = sim is not None and rank == sim.overdue_rank
                age = (now - sim.overdue_since).total_seconds() if stuck and sim else 0.4
                beats.append(
                    RankHeartbeat(
                        rank=rank,
                        local_rank=rank % run.ranks_per_node,
                        phase="step",
                        step=steps.stop - 1,
                        progress_age_s=age,
                        deadline_s=STEP_DEADLINE_S,
                        overdue=age > STEP_DEADLINE_S,
                        sent_at=(now - timedelta(seconds=0.2)).timestamp(),
                    )
                )
                times += [
                    RankStepTime(
                        rank=rank,
                        step=step,
                        compute_s=compute_s(rank, step, sim, shape.step_s * 0.8),
                        wait_s=shape.step_s * 0.1,
                        ended_at=shape.step_end(start, step).timestamp(),
                    )
                    for step in ([] if stuck else steps)
                ]
            batch = AgentBatch(
                run_id=run.run_id,
                agent_id=f"{node}-bench",
                node=node,
                seq=run.seq[node],
                sent_at=now.timestamp(),
                heartbeats=tuple(beats),
                step_times=tuple(times),
            )
            bodies.append((node, run.token, batch.to_json()))
    return bodies


@dataclass
class Tick:
    cpu: dict[str, float] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    replies: list[tuple[str, bytes]] = field(default_factory=list)
    view: v.ClusterView | None = None
    actions: list[v.Action] = field(default_factory=list)
    groups: int = 0  # transactions the ingest took

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cpu, wall = time.process_time(), time.perf_counter()
        yield
        self.cpu[name] = time.process_time() - cpu
        self.wall[name] = time.perf_counter() - wall


def one_tick(
    database: Database,
    slurm: CliSlurmClient,
    config: Config,
    bodies: Sequence[tuple[str, str, bytes]],
    now: datetime,
    *,
    steps: StepWindows,
    requests: ThreadPoolExecutor,
) -> Tick:
    """What the daemon does in one poll interval: the agents' batches, then its control pass
    (Daemon.control_pass: gather -> decide -> execute, in the same calls)."""
    tick = Tick()
    sample_every = timedelta(seconds=config.settings.retention.heartbeat_sample_s)
    committer = GroupCommitter(database, clock=lambda: now, sample_every=sample_every)
    with tick.phase("ingest"):
        committer.start()

        def post(node: str, token: str, body: bytes) -> tuple[str, bytes]:
            return node, EndpointHandler(committer).post(token, body)

        tick.replies = list(requests.map(post, *zip(*bodies, strict=True)))
        committer.stop()
    tick.groups = committer.groups
    with tick.phase("observe"), database.session() as session:
        tick.view = gather(
            session,
            slurm,
            now=now,
            max_restarts=config.settings.policy.max_restarts_without_progress,
            lemon_min_runs=config.settings.trust.lemon_min_runs,
            steps=steps,
        )
    assert tick.view.slurm_reachable
    with tick.phase("decide"):
        tick.actions = decide(tick.view, Policy.from_config(config))
    with tick.phase("act"):
        Executor(database, slurm).execute(tick.actions)
    return tick


# --- checks: the tick did its job --------------------------------------------------------------


def check_detection(
    tick: Tick, runs: Sequence[SimRun], faults: Faults, policy: Policy, *, straggler: bool
) -> None:
    """The detectors, run again on the tick's view (not timed), find the faults."""
    assert tick.view is not None
    run = next(r for r in tick.view.runs if r.run_id == runs[0].run_id)
    hangs, silence = find_hangs(run.beats, now=tick.view.now, silent_after_s=policy.silent_after_s)
    assert silence is None
    found = {(h.rank, h.kind) for h in hangs}
    expected = {(faults.overdue_rank, HangKind.OVERDUE), (faults.frozen_rank, HangKind.FROZEN)}
    assert found == expected, f"hangs found {found}, expected {expected}"
    total = sum(len(r.beats) for r in tick.view.runs)
    assert total == sum(len(r.nodes) * r.ranks_per_node for r in runs), total
    if not straggler:
        return
    stragglers = find_stragglers(
        run.compute,
        threshold=policy.straggler_threshold,
        window_buckets=policy.straggler_window_buckets,
    )
    assert [s.rank for s in stragglers] == [faults.straggler_rank], stragglers
    # Every rank but the stuck and the frozen ones has compute times in every bucket.
    assert len(run.compute) == len(runs[0].nodes) * runs[0].ranks_per_node - 2


def node_of(runs: Sequence[SimRun], rank: int) -> str:
    return runs[0].nodes[rank // runs[0].ranks_per_node]


def check_first_decisions(
    tick: Tick, runs: Sequence[SimRun], faults: Faults, *, with_spare: bool
) -> None:
    events = {(a.kind, a.rank) for a in tick.actions if isinstance(a, v.RecordEvent)}
    assert events == {
        (EventKind.HANG, faults.overdue_rank),
        (EventKind.HANG, faults.frozen_rank),
        (EventKind.STRAGGLER, faults.straggler_rank),
    }, tick.actions
    restarted = {a.node for a in tick.actions if isinstance(a, v.RestartWorkers)}
    assert restarted == {node_of(runs, faults.overdue_rank), node_of(runs, faults.frozen_rank)}
    excluded = {a.node for a in tick.actions if isinstance(a, v.ExcludeNode)}
    # A straggler leaves only when a spare can take its place.
    assert excluded == ({node_of(runs, faults.straggler_rank)} if with_spare else set()), excluded


def check_commands(tick: Tick, runs: Sequence[SimRun], faults: Faults, *, with_spare: bool) -> None:
    """The tick after the first one: the agents got the restart (and leave) commands."""
    given = {
        node: [c.kind for c in reply.commands]
        for node, reply in ((n, BatchReply.from_json(body)) for n, body in tick.replies)
        if reply.commands
    }
    expected = {
        node_of(runs, faults.overdue_rank): [CommandKind.RESTART_WORKERS.value],
        node_of(runs, faults.frozen_rank): [CommandKind.RESTART_WORKERS.value],
    }
    if with_spare:
        expected[node_of(runs, faults.straggler_rank)] = [CommandKind.LEAVE.value]
    assert given == expected, given


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2048, help="training nodes, all runs")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--runs", type=int, default=1, help="the nodes split evenly into runs")
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="spare nodes per run (with one, the straggler leaves at the first tick)",
    )
    parser.add_argument("--step-s", type=float, default=10.0, help="training step time")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=64,
        help="request threads posting batches at once (the HTTP server's threads)",
    )
    parser.add_argument("--ticks", type=int, default=5, help="measured ticks (median)")
    parser.add_argument("--db-url", default="", help="store URL (default: a fresh SQLite file)")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the measured ticks")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a daemon setting (defaults otherwise; the environment is ignored)",
    )
    args = parser.parse_args(argv)
    if args.ticks < 2:
        parser.error("--ticks must be at least 2 (the second checks the agents' commands)")
    if args.nodes % args.runs:
        parser.error("--nodes must split evenly into --runs")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_config(overrides=args.set, environ={}, system_file=Path("/nonexistent"))
    policy = Policy.from_config(config)
    shape = Shape(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        runs=args.runs,
        spares=args.spares,
        step_s=args.step_s,
        tick_s=config.settings.daemon.poll_interval_s,
        window_s=config.settings.policy.straggler_window_s,
        silent_after_s=policy.silent_after_s,
    )
    with tempfile.TemporaryDirectory(prefix="slurmft-bench-") as tmp:
        database = Database(args.db_url or f"sqlite:///{tmp}/bench.db")
        try:
            return bench(database, shape, config, policy, args)
        finally:
            database.dispose()


def bench(
    database: Database, shape: Shape, config: Config, policy: Policy, args: argparse.Namespace
) -> int:
    database.upgrade()
    with database.session() as session:
        assert not session.scalar(select(func.count()).select_from(StepTime)), "use an empty store"
    print(
        f"shape: {shape.runs} run(s), {shape.nodes} nodes x {shape.ranks_per_node} ranks = "
        f"{shape.ranks} ranks (+{shape.spares} spare node(s) per run), step {shape.step_s:g} s, "
        f"tick = poll interval {shape.tick_s:g} s, straggler window {shape.window_s:g} s "
        f"(threshold {policy.straggler_threshold:g}), silent after {shape.silent_after_s:g} s, "
        f"store {database.describe()}",
        file=sys.stderr,
    )
    print("Slurm: a fake runner prints squeue/sinfo output for the real parsers; its latency "
          "is not measured", file=sys.stderr)  # fmt: skip
    runs = create_runs(
        database, shape, submitted_at=datetime.now(UTC) - timedelta(seconds=shape.window_s + 120)
    )
    rpn = shape.ranks_per_node
    start = datetime.now(UTC)
    faults = Faults(
        overdue_rank=3 * rpn + 2,
        frozen_rank=9 * rpn + 5,
        straggler_rank=17 * rpn + 1,
        overdue_since=start - timedelta(seconds=STEP_DEADLINE_S + 60),
        frozen_since=start - timedelta(seconds=shape.silent_after_s * 3),
    )
    began = time.perf_counter()
    rows = fill_history(database, runs, shape, start, faults)
    print(f"history: {rows:,} rows in {time.perf_counter() - began:.1f} s", file=sys.stderr)
    slurm = CliSlurmClient(FakeSlurm(runs, extra_idle=64))
    # The daemon's first pass after the submission: the runs become RUNNING, and the straggler
    # window is read whole (a cold start; not part of a tick).
    steps = StepWindows()
    tune_collector()  # as the daemon does at its start, and after its first pass:
    cpu, wall = time.process_time(), time.perf_counter()
    with database.session() as session:
        gather(session, slurm, now=start, max_restarts=5, steps=steps)
    freeze_long_lived()
    print(
        f"first pass (cold straggler window, {steps.rows_read:,} rows): "
        f"cpu {time.process_time() - cpu:.3f} s wall {time.perf_counter() - wall:.3f} s",
        file=sys.stderr,
    )

    profiler = cProfile.Profile() if args.profile else None
    ticks: list[Tick] = []
    requests = ThreadPoolExecutor(args.in_flight, thread_name_prefix="request")
    for number in range(1, args.ticks + 1):
        now = start + timedelta(seconds=number * shape.tick_s)
        bodies = agent_batches(runs, shape, start, now, faults)
        if profiler:
            profiler.enable()
        tick = one_tick(database, slurm, config, bodies, now, steps=steps, requests=requests)
        if profiler:
            profiler.disable()
        # With a spare the straggler's node left at tick 1: its ranks moved, the window restarts.
        with_spare = shape.spares > 0
        check_detection(tick, runs, faults, policy, straggler=number == 1 or not with_spare)
        if number == 1:
            check_first_decisions(tick, runs, faults, with_spare=with_spare)
        else:
            assert not tick.actions, f"tick {number} repeated decisions: {tick.actions}"
        if number == 2:
            check_commands(tick, runs, faults, with_spare=with_spare)
        ticks.append(tick)
        print(
            f"tick {number}: "
            + " ".join(f"{p} {tick.cpu[p]:.3f}/{tick.wall[p]:.3f}" for p in PHASES)
            + f" | total cpu {sum(tick.cpu.values()):.3f} s wall {sum(tick.wall.values()):.3f} s"
            f", {len(tick.actions)} actions, {len(bodies)} batches in {tick.groups} transactions",
            file=sys.stderr,
        )
    with database.session() as session:
        recorded = session.scalar(
            select(func.count()).select_from(Event).where(Event.source == "daemon")
        )
    assert recorded == 3, (
        f"{recorded} daemon events recorded, expected 3 (two hangs, one straggler)"
    )
    if profiler:
        profiler.dump_stats(args.profile)
        stats = io.StringIO()
        pstats.Stats(profiler, stream=stats).sort_stats("cumulative").print_stats(30)
        print(stats.getvalue(), file=sys.stderr)
    report(ticks, shape)
    return 0


def report(ticks: Sequence[Tick], shape: Shape) -> None:
    median: dict[str, Any] = {}
    for p in PHASES:
        median[f"{p}_cpu_s"] = statistics.median(t.cpu[p] for t in ticks)
        median[f"{p}_wall_s"] = statistics.median(t.wall[p] for t in ticks)
    tick_cpu = statistics.median(sum(t.cpu.values()) for t in ticks)
    tick_wall = statistics.median(sum(t.wall.values()) for t in ticks)
    print("phase    cpu_s (median)  wall_s (median)")
    for p in PHASES:
        print(f"{p:8s} {median[f'{p}_cpu_s']:14.3f} {median[f'{p}_wall_s']:16.3f}")
    print(f"{'tick':8s} {tick_cpu:14.3f} {tick_wall:16.3f}   (goal: tick_cpu_s <= 1)")
    print(
        f"controller ranks={shape.ranks} tick_cpu_s={tick_cpu:.3f} tick_wall_s={tick_wall:.3f} "
        + " ".join(f"{k}={val:.3f}" for k, val in median.items() if k.endswith("_cpu_s"))
    )


if __name__ == "__main__":
    raise SystemExit(main())
