#!/usr/bin/env python3
"""The daemon's ingest under a large run's load: simulated agents through the real HTTP server.

A real `slurmft daemon` (its ingest server, group commit, retention and goodput passes; Slurm
unreachable, so its control pass is skipped: scripts/bench/controller.py measures that) serves
one running run of up to 2,048 nodes on a fresh store. This process is the run's agents, written
with asyncio: each posts a batch every report interval with what its node's 8 ranks produced
meanwhile at the shipped cadences (a heartbeat per rank every 5 s, slurmft.train's default; a
step every 10 s with the step times of all 8 ranks), the way slurmft.agent.reporter does: on one
kept connection (HTTP keep-alive; --connection per-post: a new one each time, as the agents did
before), at the interval slurmft's agents use in a run of that many nodes (once a second up to
1,024, less often beyond: slurmft.agent.reporter.report_interval_s; --post-every-s fixes it). A
batch not acknowledged is sent again (same seq) after a back-off, and the reports made
meanwhile wait for the next one. The bodies are encoded ahead of time, the sequence number and
times patched in per post.

The generator is pinned to CPU 0 and the daemon (and PostgreSQL's server) to CPU 1. The agents
ramp 256 -> 512 -> 1,024 -> 2,048, a minute per step and --top-s at the top, on SQLite and
PostgreSQL, with the retention windows shortened to minutes so the folding of raw step times
runs inside the measurement. Per store and step it prints

    ingest_load store=S connection=C agents=N lost=0 post_every_s=X ack_p99_ms=X
        commit_lag_p99_s=X daemon_cpu_pct=X store_cpu_pct=X gen_cpu_pct=X posts_per_s=X
        backlog_growth_per_min=X keeps_up=yes|no

ack: one request's round trip (send, the reply after the group commit); commit lag: from when
a batch was due to go (its agent's next post) to when it was acknowledged, stored: its ack when
on time, more when it waited for an earlier batch or was refused and sent
again (the second an agent holds reports to batch them is its own, not the daemon's); the
backlog: reports made and not yet acknowledged, sampled each second; its growth is the slope of
a least-squares line over the step's last 5 minutes (or all of a shorter step). Keeps up: commit
lag p99 < 2 s and the backlog does not grow by more than a second's reports over 5 minutes.
lost: batches never acknowledged, plus agents whose cursor in the store is behind their last
acknowledged batch (read at the end). daemon_cpu_pct: the daemon's CPU-seconds per wall second
x 100 (100 = one core); store_cpu_pct: PostgreSQL's server processes, the same way.

Afterwards it prints the store's bytes per row of the growing tables and, from them, the store's
size at the shipped retention windows for a run of this size (what an operator provisions).

    scripts/bench/ingest_load.py                      # the full ramp, both stores (~30 min)
    scripts/bench/ingest_load.py --ramp 64 --step-s 60 --top-s 60 --stores sqlite
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest import fresh_postgres_database, postgres_server  # noqa: E402

from slurmft.agent.reporter import report_interval_s  # noqa: E402
from slurmft.config import AgentSection  # noqa: E402
from slurmft.protocol import BATCH_PATH, CONTENT_TYPE, PROTOCOL_VERSION  # noqa: E402

RANKS_PER_NODE = 8
HEARTBEAT_EVERY_S = 5.0  # slurmft.train.heartbeat's default interval
STEP_EVERY_S = 10.0
REPORTS_PER_AGENT_S = RANKS_PER_NODE * (1 / HEARTBEAT_EVERY_S + 1 / STEP_EVERY_S)
RETRY_S = (0.5, 1.0, 2.0, 4.0)  # back-off between tries of one batch (the reporter's shape)
REQUEST_TIMEOUT_S = 30.0
GROWTH_WINDOW_S = 300.0
LAG_LIMIT_S = 2.0
# Retention shortened so that raw step times are folded (and samples deleted) during the run.
SHORT_RETENTION = {
    "SLURMFT_RETENTION_STEP_TIMES_RAW_HOURS": "0.05",  # 3 minutes
    "SLURMFT_RETENTION_HEARTBEAT_HISTORY_HOURS": "0.05",
}
# --set daemon.KEY=VALUE: a daemon setting for this run, as its environment variable.
DAEMON_SETTINGS: dict[str, str] = {}
SHIPPED_RAW_STEP_HOURS, SHIPPED_SAMPLE_HOURS, SHIPPED_SAMPLE_S = 6.0, 24.0, 60.0
RUN_ID = "rload"


# --- the agents ------------------------------------------------------------------------------


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Agent:
    index: int
    node: str
    agent_id: str
    phase_s: float  # where in each second it posts, and in each step its ranks end theirs
    seq: int = 0
    acked_seq: int = 0
    acked_until: float = 0.0  # the reports made up to this time are stored
    stream: Stream | None = None  # its kept connection


@dataclass
class Tally:
    """Everything measured in one step of the ramp."""

    acks_ms: list[float] = field(default_factory=list)
    lags_s: list[float] = field(default_factory=list)
    backlog: list[tuple[float, int]] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    first_refusal: dict[int | str, str] = field(default_factory=dict)  # status -> its reply
    posts: int = 0


@dataclass(frozen=True)
class Ramp:
    agents: list[int]
    step_s: float  # each step but the last
    top_s: float  # the last
    keep_alive: bool = True  # one connection per agent (False: one per post)
    pin: bool = True  # generator and daemon on a CPU each
    # Each agent's report interval; None: what slurmft's agents use in a run of each step's size.
    post_every_s: float | None = None

    def steps(self) -> Iterator[tuple[int, float]]:
        for i, agents in enumerate(self.agents):
            yield agents, self.top_s if i == len(self.agents) - 1 else self.step_s


class Load:
    """The agents of one run, posting to the daemon's ingest endpoint."""

    def __init__(self, host: str, port: int, token: str, ramp: Ramp) -> None:
        self.host, self.port = host, port
        self.keep_alive, self.ramp = ramp.keep_alive, ramp
        self.post_every_s = 1.0  # set for each step of the ramp
        agents = max(ramp.agents)
        self.head = (
            f"POST {BATCH_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {CONTENT_TYPE}"
            f"\r\nAuthorization: Bearer {token}\r\n"
        ).encode()
        self.agents = [
            Agent(i, f"n{i:05d}", uuid.uuid4().hex, random.random()) for i in range(agents)
        ]
        self.active = 0
        self.tally = Tally()
        self.started = time.time()
        self.stopping = False
        self.unacked_at_end = 0

    def grow_to(self, count: int) -> list[Agent]:
        new = self.agents[self.active : count]
        self.active = count
        return new

    def body(self, agent: Agent, now: float, since: float) -> tuple[bytes, int]:
        """The agent's batch for the reports made in (since, now]: its ranks' heartbeats and
        step times due in that span; how many reports it carries."""
        beats, times = [], []
        for local in range(RANKS_PER_NODE):
            rank = agent.index * RANKS_PER_NODE + local
            offset = agent.phase_s + local * HEARTBEAT_EVERY_S / RANKS_PER_NODE
            for due in _ticks(since, now, HEARTBEAT_EVERY_S, offset):
                step = int((due - self.started) // STEP_EVERY_S)
                beats.append(
                    b'{"rank":%d,"local_rank":%d,"phase":"step","step":%d,"progress_age_s":'
                    b'%.3f,"deadline_s":600.0,"overdue":false,"sent_at":%.3f,"pid":%d}'
                    % (rank, local, step, (due - agent.phase_s) % STEP_EVERY_S, due, 1000 + local)
                )
        for ended in _ticks(since, now, STEP_EVERY_S, agent.phase_s * STEP_EVERY_S):
            step = int((ended - self.started) // STEP_EVERY_S)
            for local in range(RANKS_PER_NODE):
                compute = 9.0 + 0.01 * local
                times.append(
                    b'{"rank":%d,"step":%d,"compute_s":%.3f,"wait_s":%.3f,"ended_at":%.3f}'
                    % (agent.index * RANKS_PER_NODE + local, step, compute, 10.0 - compute, ended)
                )
        body = b'{"v":%d,"run_id":"%s","agent_id":"%s","node":"%s","seq":%d,"sent_at":%.3f,' % (
            PROTOCOL_VERSION,
            RUN_ID.encode(),
            agent.agent_id.encode(),
            agent.node.encode(),
            agent.seq,
            now,
        ) + b'"heartbeats":[%s],"step_times":[%s]}' % (b",".join(beats), b",".join(times))
        return body, len(beats) + len(times)

    async def run_agent(self, agent: Agent) -> None:
        loop = asyncio.get_running_loop()
        to_wall = time.time() - loop.time()
        agent.acked_until = since = time.time()
        slot = loop.time() + agent.phase_s * self.post_every_s  # its next post
        while not self.stopping:
            await asyncio.sleep(max(slot - loop.time(), 0.0))
            if self.stopping:
                return
            began, now = loop.time(), time.time()
            agent.seq += 1
            body, _ = self.body(agent, now, since)
            await self.deliver(agent, body, due=slot + to_wall)
            agent.acked_until = since = now
            # The batch covered every slot up to when it went; one that went late (or waited
            # for its ack) is followed at once by one with what accrued meanwhile.
            while slot <= began:
                slot += self.post_every_s

    async def deliver(self, agent: Agent, body: bytes, due: float) -> None:
        """Post until acknowledged (the reporter's retry: same seq, back-off)."""
        tries = 0
        while True:
            began = time.time()
            status = await self.post(agent, body)
            self.tally.posts += 1
            if status == 200:
                done = time.time()
                self.tally.acks_ms.append((done - began) * 1e3)
                if done - began > 0.5 and os.environ.get("INGEST_LOAD_DEBUG"):
                    print(
                        f"slow ack {done - began:.2f} s at +{began - self.started:.1f} s",
                        file=sys.stderr,
                    )
                self.tally.lags_s.append(done - due)
                agent.acked_seq = agent.seq
                return
            key = str(status)
            self.tally.refused[key] = self.tally.refused.get(key, 0) + 1
            if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
                return  # never taken (the reporter drops it too): counted lost at the end
            if self.stopping and tries >= len(RETRY_S):
                return
            await asyncio.sleep(RETRY_S[min(tries, len(RETRY_S) - 1)] * (0.5 + random.random()))
            tries += 1

    async def post(self, agent: Agent, body: bytes) -> int | str:
        """One request: on the agent's kept connection (slurmft.agent.reporter's keep-alive;
        once more on a new one if the daemon closed the kept one meanwhile), or on a new
        connection per post (--connection per-post: the agents before keep-alive). The HTTP
        status, or what went wrong."""
        for attempt in (1, 2):
            reused = agent.stream is not None
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    if agent.stream is None:
                        agent.stream = await asyncio.open_connection(self.host, self.port)
                    status, keep = await self._exchange(agent.stream, body)
            except TimeoutError:
                await self._close(agent)
                return "timeout"
            except (OSError, asyncio.IncompleteReadError, ValueError) as error:
                await self._close(agent)
                if reused and attempt == 1:
                    continue
                return type(error).__name__
            if not (keep and self.keep_alive):
                await self._close(agent)
            return status
        raise AssertionError("unreachable")

    async def _exchange(self, stream: Stream, body: bytes) -> tuple[int | str, bool]:
        reader, writer = stream
        connection = b"" if self.keep_alive else b"Connection: close\r\n"
        writer.write(self.head + connection + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionResetError("closed before the reply")
        length, keep = 0, status_line.startswith(b"HTTP/1.1")
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
        reply = await reader.readexactly(length)
        parts = status_line.split()
        status: int | str = int(parts[1]) if len(parts) > 1 else "no-status"
        if status != 200 and status not in self.tally.first_refusal:
            self.tally.first_refusal[status] = reply[:200].decode(errors="replace")
        return status, keep

    @staticmethod
    async def _close(agent: Agent) -> None:
        if agent.stream is not None:
            _, writer = agent.stream
            agent.stream = None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def backlog(self) -> int:
        now = time.time()
        return round(sum(now - agent.acked_until for agent in self.agents[: self.active])
                     * REPORTS_PER_AGENT_S)  # fmt: skip


def _ticks(since: float, until: float, every: float, offset: float) -> Iterator[float]:
    """The times in (since, until] of a cadence of ``every`` seconds shifted by ``offset``."""
    k = (since - offset) // every + 1
    while (t := offset + k * every) <= until:
        yield t
        k += 1


# --- measuring -------------------------------------------------------------------------------


def _cpu_s(pids: list[int]) -> dict[int, float]:
    """CPU-seconds used so far by each of these processes (user + system, from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            used[pid] = (int(fields[11]) + int(fields[12])) / ticks
    return used


def _cpu_since(before: dict[int, float], pids: list[int]) -> float:
    """CPU-seconds these processes used since ``before`` (one born since: all of its own)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in _cpu_s(pids).items())


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def _slope_per_min(samples: list[tuple[float, int]]) -> float:
    if len(samples) < 3:
        return 0.0
    xs = [t for t, _ in samples]
    ys = [float(n) for _, n in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if not den:
        return 0.0
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    postgres: bool = False

    def store_pids(self) -> list[int]:
        """PostgreSQL's server processes, its backends for the daemon's connections too."""
        return _postgres_pids() if self.postgres else []


Result = dict[str, float | int | str]


async def ramp_step(load: Load, daemon: Daemon, agents: int, seconds: float,
                    tasks: list[asyncio.Task[None]]) -> Result:  # fmt: skip
    for agent in load.grow_to(agents):
        tasks.append(asyncio.create_task(load.run_agent(agent)))
    load.tally = Tally()
    load.post_every_s = load.ramp.post_every_s or report_interval_s(
        AgentSection.report_interval_s, agents
    )
    daemon_cpu0, store_cpu0 = _cpu_s([daemon.proc.pid]), _cpu_s(daemon.store_pids())
    gen_cpu0 = _self_cpu_s()
    began = time.monotonic()
    while (elapsed := time.monotonic() - began) < seconds:
        await asyncio.sleep(1.0)
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited ({daemon.proc.returncode})")
        load.tally.backlog.append((elapsed, load.backlog()))
    wall = time.monotonic() - began
    cpu = (_cpu_since(daemon_cpu0, [daemon.proc.pid]),
           _cpu_since(store_cpu0, daemon.store_pids()), _self_cpu_s() - gen_cpu0)  # fmt: skip
    tally = load.tally
    window = [(t, n) for t, n in tally.backlog if t >= wall - GROWTH_WINDOW_S]
    growth = _slope_per_min(window)
    reports_per_s = agents * REPORTS_PER_AGENT_S
    lag = _p99(tally.lags_s)
    grew = growth * min(wall, GROWTH_WINDOW_S) / 60.0
    return {
        "agents": agents,
        "post_every_s": load.post_every_s,
        "ack_p99_ms": round(_p99(tally.acks_ms), 1),
        "ack_p50_ms": round(statistics.median(tally.acks_ms), 1) if tally.acks_ms else "nan",
        "commit_lag_p99_s": round(lag, 3),
        "daemon_cpu_pct": round(100 * cpu[0] / wall, 1),
        "store_cpu_pct": round(100 * cpu[1] / wall, 1),
        "gen_cpu_pct": round(100 * cpu[2] / wall, 1),
        "posts_per_s": round(tally.posts / wall, 1),
        "refused": sum(tally.refused.values()),
        "backlog_growth_per_min": round(growth, 1),
        "keeps_up": "yes" if lag < LAG_LIMIT_S and grew <= reports_per_s else "no",
    }


# --- the daemon and its store ----------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _cpus() -> tuple[int | None, int | None]:
    """(generator's CPU, daemon's CPU), or no pinning on a one-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("only one CPU: generator and daemon share it (not pinned)", file=sys.stderr)
        return None, None
    return cpus[0], cpus[1]


def _seed_run(url: str, agents: int) -> str:
    """The run the agents report for (running, with a job), and its token."""
    from slurmft.controller.ingest import new_run_token
    from slurmft.db import Database
    from slurmft.db.models import Attempt, Run
    from slurmft.db.states import AttemptState, RunState

    database = Database(url)
    database.upgrade()
    token, digest = new_run_token()
    now = datetime.now(UTC)
    with database.session() as s:
        run = Run(id=RUN_ID, name="load", owner_uid=0, owner_name="root", nodes=agents,
                  command=["train.py"], token_hash=digest, started_at=now)  # fmt: skip
        s.add(run)
        s.flush()
        run.state = RunState.RUNNING
        attempt = Attempt(run_id=RUN_ID, number=1, slurm_job_id="990001", submitted_at=now,
                          started_at=now)  # fmt: skip
        s.add(attempt)
        s.flush()
        attempt.state = AttemptState.RUNNING
    database.dispose()
    return token


@contextlib.contextmanager
def running_daemon(directory: Path, url: str, cpu: int | None, postgres: bool) -> Iterator[Daemon]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")} | {
        "SLURMFT_PATHS_STATE_DIR": str(directory / "state"),
        "SLURMFT_PATHS_RUNTIME_DIR": str(directory / "run"),
        "SLURMFT_DATABASE_URL": url,
        "SLURMFT_DAEMON_INGEST_LISTEN": f"127.0.0.1:{port}",
        "SLURMFT_DAEMON_METRICS_LISTEN": "127.0.0.1:0",
        "SLURMFT_SLURM_CONF": str(directory / "no-slurm.conf"),  # Slurm away: ingest only
        "SLURM_CONF": str(directory / "no-slurm.conf"),
        **SHORT_RETENTION,
        **DAEMON_SETTINGS,
    }
    log = (directory / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmft", "daemon"], env=env, stdout=log, stderr=log,
        preexec_fn=lambda: _pin(cpu),  # noqa: PLW1509  # affinity only, before exec
    )  # fmt: skip
    try:
        _wait_listening("127.0.0.1", port, proc, directory / "daemon.log")
        yield Daemon(proc, "127.0.0.1", port, postgres)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the daemon's ingest endpoint did not open:\n{log.read_text()[-3000:]}")


def _pgrep(*args: str) -> list[int]:
    found = subprocess.run(["pgrep", *args], check=False, capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _postgres_pids() -> list[int]:
    """The throwaway PostgreSQL server's processes (its postmaster, started on a data directory
    under slurmft-bench-pg-*, and their children); none for a server given by URL."""
    masters = _pgrep("-f", "postgres -D .*slurmft-bench-pg-")
    return [*masters, *(pid for master in masters for pid in _pgrep("-P", str(master)))]


# --- the store's size ------------------------------------------------------------------------

GROWING = ("step_times", "step_time_minutes", "rank_heartbeat_samples", "rank_heartbeats")


def bytes_per_row(url: str) -> dict[str, tuple[int, float]]:
    """Each growing table's rows and bytes per row (data and indexes)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    found: dict[str, tuple[int, float]] = {}
    with engine.connect() as conn:
        for table in GROWING:
            rows = int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
            if url.startswith("sqlite"):
                size = conn.execute(
                    text("SELECT sum(pgsize) FROM dbstat WHERE name = :t OR name IN "
                         "(SELECT name FROM sqlite_master WHERE tbl_name = :t)"), {"t": table}
                ).scalar_one()  # fmt: skip
            else:
                size = conn.execute(
                    text("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": table}
                ).scalar_one()
            found[table] = (rows, (size or 0) / rows if rows else float("nan"))
    engine.dispose()
    return found


def shipped_sizes(per_row: dict[str, tuple[int, float]], agents: int) -> str:
    """The store's size for a run of ``agents`` nodes at the shipped retention windows: raw step
    times for raw_step_hours, heartbeat samples (one a minute per rank) for sample_hours, and
    the per-rank per-minute aggregates the raw step times fold into, kept for good."""
    ranks = agents * RANKS_PER_NODE
    raw_rows = ranks / STEP_EVERY_S * 3600 * SHIPPED_RAW_STEP_HOURS
    sample_rows = ranks * 3600 / SHIPPED_SAMPLE_S * SHIPPED_SAMPLE_HOURS
    minute_rows_per_h = ranks * 60
    gb = 1e9
    raw = raw_rows * per_row["step_times"][1] / gb
    samples = sample_rows * per_row["rank_heartbeat_samples"][1] / gb
    minutes = minute_rows_per_h * per_row["step_time_minutes"][1] / gb
    return (
        f"store_size agents={agents} raw_step_times_gb={raw:.2f} "
        f"heartbeat_samples_gb={samples:.2f} minute_aggregates_gb_per_h={minutes:.3f} "
        f"raw_step_hours={SHIPPED_RAW_STEP_HOURS:g} sample_hours={SHIPPED_SAMPLE_HOURS:g}"
    )


# --- one store -------------------------------------------------------------------------------


def _cursors_behind(url: str, load: Load) -> int:
    """Agents whose cursor in the store is behind their last acknowledged batch."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as conn:
        rows = dict(
            conn.execute(
                text("SELECT agent_id, last_seq FROM agent_cursors WHERE run_id = :r"),
                {"r": RUN_ID},
            ).all()
        )
    engine.dispose()
    return sum(1 for a in load.agents[: load.active] if rows.get(a.agent_id, 0) < a.acked_seq)


async def _drive(load: Load, daemon: Daemon, ramp: Ramp, store: str) -> list[Result]:
    tasks: list[asyncio.Task[None]] = []
    results = []
    try:
        for agents, seconds in ramp.steps():
            result = await ramp_step(load, daemon, agents, seconds, tasks)
            print(f"  {store} {agents} agents: {result}", file=sys.stderr, flush=True)
            for status, reply in load.tally.first_refusal.items():
                print(f"    refused {status}: {reply}", file=sys.stderr, flush=True)
            results.append(result)
    finally:
        load.stopping = True
        # Let batches in flight finish (each agent's delivery retries a few times at most).
        _, pending = await asyncio.wait(tasks, timeout=60) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        load.unacked_at_end = sum(1 for a in load.agents[: load.active] if a.acked_seq < a.seq)
    return results


def bench_store(store: str, url: str, directory: Path, ramp: Ramp) -> None:
    gen_cpu, daemon_cpu = _cpus() if ramp.pin else (None, None)
    token = _seed_run(url, max(ramp.agents))
    # PostgreSQL's server beside the daemon: its backends, forked later, inherit the CPU.
    for pid in _postgres_pids() if store == "postgres" and daemon_cpu is not None else []:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, {daemon_cpu})
    with running_daemon(directory, url, daemon_cpu, postgres=store == "postgres") as daemon:
        _pin(gen_cpu)
        load = Load(daemon.host, daemon.port, token, ramp)
        try:
            results = asyncio.run(_drive(load, daemon, ramp, store))
        finally:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        lost = load.unacked_at_end + _cursors_behind(url, load)
        for result in results:
            fields = " ".join(f"{k}={v}" for k, v in result.items() if k != "agents")
            connection = "kept" if ramp.keep_alive else "per-post"
            print(f"ingest_load store={store} connection={connection} agents={result['agents']} "
                  f"lost={lost} {fields}",
                  flush=True)  # fmt: skip
        per_row = bytes_per_row(url)
        rows = " ".join(f"{t}={n}" for t, (n, _) in per_row.items())
        sizes = " ".join(f"{t}={b:.0f}" for t, (_, b) in per_row.items())
        print(f"store_rows store={store} {rows}", flush=True)
        print(f"store_bytes_per_row store={store} {sizes}", flush=True)
        print(shipped_sizes(per_row, max(ramp.agents)), flush=True)


@contextlib.contextmanager
def _work_dir(keep: bool) -> Iterator[Path]:
    if keep:
        yield Path(tempfile.mkdtemp(prefix="slurmft-ingest-load-"))
        return
    with tempfile.TemporaryDirectory(prefix="slurmft-ingest-load-") as tmp:
        yield Path(tmp)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ramp", default="256,512,1024,2048", help="agent counts, in order")
    parser.add_argument("--step-s", type=float, default=60.0, help="seconds per ramp step")
    parser.add_argument("--top-s", type=float, default=600.0, help="seconds at the last step")
    parser.add_argument("--stores", default="sqlite,postgres")
    parser.add_argument(
        "--connection",
        choices=("kept", "per-post"),
        default="kept",
        help="kept: one connection per agent, as the agents keep it alive; per-post: a new one "
        "for every post (the agents before keep-alive)",
    )
    parser.add_argument(
        "--post-every-s",
        type=float,
        default=None,
        help="each agent's report interval (default: what slurmft.agent gives a run of the "
        "ramp's last size)",
    )
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="leave CPU placement to the kernel"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a daemon setting for the run, e.g. daemon.ingest_workers=1024",
    )
    parser.add_argument("--keep", action="store_true", help="keep the daemon's files and log")
    parser.add_argument("--postgres-url", default=os.environ.get("SLURMFT_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    for setting in args.set:
        key, sep, value = setting.partition("=")
        if not sep or "." not in key:
            parser.error(f"--set {setting!r}: expected SECTION.KEY=VALUE")
        DAEMON_SETTINGS["SLURMFT_" + key.replace(".", "_").upper()] = value
    agents = [int(n) for n in args.ramp.split(",")]
    ramp = Ramp(
        agents,
        args.step_s,
        args.top_s,
        args.connection == "kept",
        args.pin,
        args.post_every_s,
    )
    stores = args.stores.split(",")
    if unknown := set(stores) - {"sqlite", "postgres"}:
        parser.error(f"unknown store {', '.join(sorted(unknown))} (sqlite, postgres)")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 2 * max(ramp.agents) + 256:
        print(f"open files limit {hard} is low for {max(ramp.agents)} agents", file=sys.stderr)
    for store in stores:
        with _work_dir(args.keep) as directory:
            if args.keep:
                print(f"  {store}: the daemon's files are kept in {directory}", file=sys.stderr)
            if store == "sqlite":
                bench_store(store, f"sqlite:///{directory / 'slurmft.db'}", directory, ramp)
                continue
            with (
                postgres_server(args.postgres_url, durable=True) as server,
                fresh_postgres_database(server) as url,
            ):
                bench_store(store, url, directory, ramp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
