#!/usr/bin/env python3
"""The rendezvous at scale: how long a round takes to complete after one member leaves.

Real `DynamicRendezvousHandler`s (torch's c10d backend, one TCPStore client each, as each
torchrun agent has) on one store started the way slurmft starts it (`StoreSupervisor`, a
`python -m slurmft.agent.store` server process pinged every second). The handlers run as threads
of `--processes` worker processes (torch imported once per process), spread evenly; each worker
applies slurmft's rendezvous patch (`rdzv_fix.apply`) to its own torch module, as the launcher
does in torchrun's process, with the poll under test: 0.1 s (slurmft's fastest) or 1 s, which
leaves torch's own poll untouched (the wait-list fix alone, what the launcher applies when
`default_rdzv_poll_s` is 1 s). With `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` as slurmft sets it.

A run of M members is slurmft's `--nnodes=N:N` with one hot spare: min = max = M - 1 nodes,
keep-alive 1 s x 4 (slurmft.config's defaults), so the first round completes with M - 1 and the
last member waits in the redundancy list. While a round trains each member does what torchrun's
monitor loop does to the rendezvous: `num_nodes_waiting()` every 0.1 s (a state read at most once
a second through torch's cache).

The leave is a node's death, as slurmft sees it most: torch offers no clean leave for one node
(`shutdown()` closes the whole rendezvous), and an agent that leaves on purpose stops torchrun,
which stops its heartbeats without closing anything. So one participant stops its keep-alive
timer and never calls the rendezvous again (t_leave), and at that moment every other participant
calls `next_rendezvous()` again, as torchrun survivors do once their workers fail on the dead
peer (~0.1 s after a kill, docs/agent.md). The new round completes once the dead node's last
heartbeat is older than 4 s (someone's sync removes it, which opens the round) and every
survivor and the spare have joined. Reported per member of the new round:
- `rejoin_round_s`: from t_leave to `next_rendezvous()` returning (median and max, pooled over
  `--reps` leaves; before each further leave a fresh spare joins the redundancy list);
- `after_expiry_s`: the same end, from the moment the dead node's heartbeat expired (its last
  heartbeat in the store + 4 s): the rendezvous protocol's own part, which the poll decides;
  `expiry_s` is the part before it (up to 4 s, from heartbeat timing alone).
The store's load over the leave windows: the server process's CPU, the store requests the
handlers made per second (counted in each process), and the round trip of a ping every 50 ms;
`train_*` is the same over a 2 s window of training before the first leave.

CPU-bound on a small machine: every member is a Python thread on the same host as the store, so
the times are an upper bound for the same members on a real network.

    .venv/bin/python scripts/bench/rendezvous_scale.py [--members 32,64,128,256]
        [--processes 8] [--per-process 32] [--polls 0.1,1] [--reps 3] [--quick]

One line per setting: `rendezvous_scale members=M poll=slurmft(0.1s) first_round_s=...
rejoin_round_s_p50=... rejoin_round_s_max=... after_expiry_s_p50=... ...`; a setting whose
round did not complete in `--timeout-s` says `failed=yes` with the rendezvous state as one worker
read it (the next setting gets fresh workers), and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from slurmft.agent import rdzv_fix  # noqa: E402
from slurmft.agent.store import StoreSupervisor, ping_store  # noqa: E402
from slurmft.config import AgentSection  # noqa: E402

LOOPBACK = "127.0.0.1"
KEEP_ALIVE_INTERVAL_S = AgentSection.keep_alive_interval_s
KEEP_ALIVE_MAX_ATTEMPTS = AgentSection.keep_alive_max_attempts
MONITOR_INTERVAL_S = 0.1  # torchrun's --monitor-interval
JOIN_TIMEOUT_S = 600  # slurmft's join_timeout
STORE_TIMEOUT_S = 120
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


# --- worker process: imports torch once, hosts members as threads -----------------------------

_out_lock = threading.Lock()


def emit(event: dict[str, Any]) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


class Member:
    """One node's rendezvous handler, as torchrun's agent drives it."""

    def __init__(self, ident: int, worker: Worker) -> None:
        from torch.distributed import TCPStore  # noqa: TID251
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: TID251
            C10dRendezvousBackend,
        )

        ops, run_id, module = worker.ops, worker.run_id, worker.module

        class CountingBackend(C10dRendezvousBackend):
            def _call_store(self, store_op: str, *args: Any, **kwargs: Any) -> Any:
                ops.add()
                return super()._call_store(store_op, *args, **kwargs)

        self.ident = ident
        self.store = TCPStore(
            LOOPBACK, worker.port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
        )
        self.handler = module.DynamicRendezvousHandler.from_backend(
            run_id,
            self.store,
            CountingBackend(self.store, run_id),
            min_nodes=worker.nodes,
            max_nodes=worker.nodes,
            local_addr=LOOPBACK,
            timeout=module.RendezvousTimeout(join=timedelta(seconds=JOIN_TIMEOUT_S)),
            keep_alive_interval=KEEP_ALIVE_INTERVAL_S,
            keep_alive_max_attempt=KEEP_ALIVE_MAX_ATTEMPTS,
        )
        self.training = False
        self.rejoin = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"member{ident}", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                info = self.handler.next_rendezvous()
            except Exception as error:  # reported; the coordinator fails the run
                emit({"ev": "error", "id": self.ident, "error": repr(error)})
                return
            done = time.time()
            self.training = True  # before the report: a rejoin may follow it at once
            emit(
                {
                    "ev": "joined",
                    "id": self.ident,
                    "t": done,
                    "rank": info.rank,
                    "world": info.world_size,
                    "round": self.handler._state_holder.state.round,
                }
            )
            while not self.rejoin.wait(MONITOR_INTERVAL_S):  # torchrun's monitor loop
                try:
                    self.handler.num_nodes_waiting()
                except Exception as error:
                    emit({"ev": "error", "id": self.ident, "error": repr(error)})
                    return
            self.training = False
            self.rejoin.clear()

    def leave(self) -> float:
        """Dies as a killed node does: no more heartbeats, no more rendezvous calls."""
        self.stop.set()
        self.rejoin.set()
        left_at = time.time()
        self.handler._stop_heartbeats()  # joins the timer thread: no heartbeat after this
        self.thread.join(timeout=30)
        return left_at


class Worker:
    def __init__(self, port: int, module: Any) -> None:
        from torch.distributed import TCPStore  # noqa: TID251

        self.port, self.module = port, module
        self.ops = Counter()
        self.members: dict[int, Member] = {}
        self.run_id = ""
        self.nodes = 0
        self.inspector = TCPStore(
            LOOPBACK, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
        )

    def state(self) -> Any:
        from base64 import b64decode

        raw = self.inspector.get("torch.rendezvous." + self.run_id)
        return pickle.loads(b64decode(raw))

    def handle(self, command: dict[str, Any]) -> None:
        kind = command["cmd"]
        if kind == "start":
            self.run_id, self.nodes = command["run"], command["nodes"]
            self.members = {i: Member(i, self) for i in command["ids"]}
            emit({"ev": "ready"})
        elif kind == "go":
            for member in self.members.values():
                member.thread.start()
        elif kind == "leave":
            member = self.members[command["id"]]
            left_at = member.leave()
            last = self.state().last_heartbeats.get(member.handler._this_node)
            emit(
                {
                    "ev": "left",
                    "id": member.ident,
                    "t": left_at,
                    "last_heartbeat": None if last is None else last.timestamp(),
                }
            )
        elif kind == "rejoin":
            for member in self.members.values():
                if member.training and not member.stop.is_set():
                    member.rejoin.set()
        elif kind == "spare":
            self.spare(command["id"], command["timeout_s"])
        elif kind == "stats":
            emit({"ev": "stats", "ops": self.ops.value})
        elif kind == "inspect":
            emit({"ev": "inspect", **self.summary()})
        elif kind == "stop":
            for member in self.members.values():
                member.stop.set()
                member.rejoin.set()
                member.handler._stop_heartbeats()
            self.members = {}
            emit({"ev": "stopped"})

    def summary(self) -> dict[str, Any]:
        """The rendezvous state in numbers (what a failed setting reports)."""
        state = self.state()
        now = time.time()
        ages = [now - beat.timestamp() for beat in state.last_heartbeats.values()]
        expiry_s = KEEP_ALIVE_INTERVAL_S * KEEP_ALIVE_MAX_ATTEMPTS
        return {
            "round": state.round,
            "complete": state.complete,
            "participants": len(state.participants),
            "wait_list": len(state.wait_list),
            "redundancy_list": len(state.redundancy_list),
            "heartbeats_expired": sum(age > expiry_s for age in ages),
            "oldest_heartbeat_s": round(max(ages, default=0.0), 1),
        }

    def spare(self, ident: int, timeout_s: float) -> None:
        """A replacement node: joins, and waits in the redundancy list."""
        member = Member(ident, self)
        self.members[ident] = member
        member.thread.start()
        deadline = time.monotonic() + timeout_s
        node = member.handler._this_node
        while time.monotonic() < deadline:
            if node in self.state().redundancy_list:
                emit({"ev": "spare_waiting", "id": ident})
                return
            time.sleep(0.05)
        emit({"ev": "error", "id": ident, "error": "the spare never reached the redundancy list"})


def worker_main(port: int, poll_s: float) -> None:
    from slurmft.agent.launcher import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the coordinator closes stdin
    module = rdzv_fix.load_module()
    problems = rdzv_fix.check_internals(module)
    if problems:
        emit({"ev": "error", "error": "; ".join(problems)})
        return
    rdzv_fix.apply(module, poll_s)
    worker = Worker(port, module)
    emit({"ev": "hello", "poll_s": rdzv_fix.poll_interval(module), "pid": os.getpid()})
    for line in sys.stdin:  # EOF: the coordinator is gone
        command = json.loads(line)
        if command["cmd"] == "exit":
            break
        try:
            worker.handle(command)
        except Exception as error:
            emit({"ev": "error", "error": repr(error)})
    os._exit(0)  # member threads may be blocked in the store: do not wait for them


# --- coordinator -------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S  # utime, stime


class BenchError(RuntimeError):
    pass


class Pool:
    """The worker processes of one poll setting, with their event streams."""

    def __init__(self, count: int, port: int, poll_s: float, log_dir: Path, timeout_s: float):
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[Path] = []
        self.timeout_s = timeout_s
        env = {**os.environ, **ENV}
        for index in range(count):
            log = log_dir / f"worker-{poll_s:g}-{index}.log"
            self.logs.append(log)
            with log.open("w") as stderr:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        "--port",
                        str(port),
                        "--poll",
                        str(poll_s),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    env=env,
                )
            self.procs.append(proc)
            assert proc.stdout is not None
            threading.Thread(target=self._read, args=(index, proc.stdout), daemon=True).start()

    def _read(self, index: int, stream: TextIO) -> None:
        for line in stream:
            self.events.put((index, json.loads(line)))
        self.events.put((index, {"ev": "eof"}))

    def send(self, index: int, command: dict[str, Any]) -> None:
        stdin = self.procs[index].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def broadcast(self, command: dict[str, Any]) -> None:
        for index in range(len(self.procs)):
            self.send(index, command)

    def expect(
        self, kind: str, count: int, what: str, timeout_s: float | None = None
    ) -> list[tuple[int, dict[str, Any]]]:
        """The next `count` events of `kind`; any error or dead worker fails the run."""
        found: list[tuple[int, dict[str, Any]]] = []
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while len(found) < count:
            left = deadline - time.monotonic()
            try:
                index, event = self.events.get(timeout=max(0.0, left))
            except queue.Empty:
                raise BenchError(
                    f"{what}: {len(found)} of {count} within {timeout_s:g} s"
                ) from None
            if event["ev"] in ("error", "eof"):
                tail = self.logs[index].read_text()[-2000:]
                raise BenchError(f"{what}: worker {index}: {event}\n{tail}")
            if event["ev"] == kind:
                found.append((index, event))
        return found

    def inspect(self) -> str:
        """The rendezvous state as one worker reads it; '' when it cannot."""
        try:
            self.send(0, {"cmd": "inspect"})
            ((_, state),) = self.expect("inspect", 1, "inspect", timeout_s=30)
        except (BenchError, OSError):
            return ""
        return ",".join(f"{k}:{v}" for k, v in state.items() if k != "ev")

    def ops(self) -> int:
        self.broadcast({"cmd": "stats"})
        return sum(event["ops"] for _, event in self.expect("stats", len(self.procs), "stats"))

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write('{"cmd": "exit"}\n')
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


class Pinger:
    """The store's round trip, every 50 ms while running."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[float] = []
        self._on = threading.Event()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            if self._on.is_set():
                try:
                    self.samples.append(ping_store(LOOPBACK, self.port, timeout_s=5.0))
                except OSError:
                    self.samples.append(5.0)

    def measuring(self, on: bool) -> None:
        (self._on.set if on else self._on.clear)()

    def close(self) -> None:
        self._stop.set()


class Load:
    """CPU of the store and of the workers, store requests and pings over measured windows."""

    def __init__(self, store_pid: int, pool: Pool, pinger: Pinger) -> None:
        self.store_pid, self.pool, self.pinger = store_pid, pool, pinger
        self.seconds = self.store_cpu = self.workers_cpu = 0.0
        self.requests = 0
        self.pings: list[float] = []
        self._start = (0.0, 0.0, 0.0, 0)

    def _snapshot(self) -> tuple[float, float, float, int]:
        workers = sum(cpu_s(proc.pid) for proc in self.pool.procs)
        return time.time(), cpu_s(self.store_pid), workers, self.pool.ops()

    def begin(self) -> None:
        self.pinger.samples.clear()
        self.pinger.measuring(True)
        self._start = self._snapshot()

    def end(self) -> None:
        self.pinger.measuring(False)
        end = self._snapshot()
        self.seconds += end[0] - self._start[0]
        self.store_cpu += end[1] - self._start[1]
        self.workers_cpu += end[2] - self._start[2]
        self.requests += end[3] - self._start[3]
        self.pings += self.pinger.samples

    def summary(self, prefix: str) -> dict[str, str]:
        pings = sorted(self.pings) or [0.0]
        return {
            f"{prefix}store_cpu_pct": f"{100 * self.store_cpu / self.seconds:.0f}",
            f"{prefix}workers_cpu_pct": f"{100 * self.workers_cpu / self.seconds:.0f}",
            f"{prefix}store_requests_per_s": f"{self.requests / self.seconds:.0f}",
            f"{prefix}ping_ms_p50": f"{1000 * statistics.median(pings):.1f}",
            f"{prefix}ping_ms_max": f"{1000 * pings[-1]:.1f}",
        }


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Setting:
    """One member count at one poll: the first round, then `reps` leaves."""

    def __init__(self, pool: Pool, members: int, label: str, store_pid: int, pinger: Pinger):
        self.pool, self.members, self.label = pool, members, label
        self.nodes = members - 1  # --nnodes=N:N with one hot spare
        self.placed: dict[int, int] = {i: i % len(pool.procs) for i in range(members)}
        self.participants: set[int] = set()
        self.train = Load(store_pid, pool, pinger)
        self.leaves = Load(store_pid, pool, pinger)
        self.rejoin: list[float] = []
        self.after_expiry: list[float] = []
        self.expiry: list[float] = []

    def first_round(self) -> float:
        pool = self.pool
        run_id = f"scale-{self.members}-{self.label}-{os.getpid()}"
        for index in range(len(pool.procs)):
            ids = [i for i, p in self.placed.items() if p == index]
            pool.send(index, {"cmd": "start", "run": run_id, "nodes": self.nodes, "ids": ids})
        pool.expect("ready", len(pool.procs), "clients connected")
        go = time.time()
        pool.broadcast({"cmd": "go"})
        first = [e for _, e in pool.expect("joined", self.nodes, "the first round")]
        self.participants = {e["id"] for e in first}
        took = max(e["t"] for e in first) - go
        progress(f"members={self.members} poll={self.label}: first round in {took:.2f} s")
        return took

    def add_spare(self, ident: int, at: int) -> None:
        """A replacement node on the process of the last one lost."""
        self.placed[ident] = at
        self.pool.send(at, {"cmd": "spare", "id": ident, "timeout_s": self.pool.timeout_s})
        self.pool.expect("spare_waiting", 1, "a new spare in the redundancy list")

    def leave(self, victim: int) -> None:
        pool = self.pool
        self.leaves.begin()
        pool.send(self.placed[victim], {"cmd": "leave", "id": victim})
        ((_, left),) = pool.expect("left", 1, "the leave")
        pool.broadcast({"cmd": "rejoin"})
        joined = [e for _, e in pool.expect("joined", self.nodes, "the round after a leave")]
        self.leaves.end()
        worlds = {e["world"] for e in joined}
        rounds = {e["round"] for e in joined}
        ids = {e["id"] for e in joined}
        if worlds != {self.nodes} or len(rounds) != 1 or len(ids) != self.nodes or victim in ids:
            raise BenchError(
                f"the round after the leave is wrong: worlds {worlds}, rounds {rounds}, "
                f"{len(ids)} members, the one that left in it: {victim in ids}"
            )
        if left["last_heartbeat"] is None:
            raise BenchError("the leaving member had no heartbeat in the store")
        expired_at = left["last_heartbeat"] + KEEP_ALIVE_INTERVAL_S * KEEP_ALIVE_MAX_ATTEMPTS
        self.expiry.append(expired_at - left["t"])
        self.rejoin += [e["t"] - left["t"] for e in joined]
        self.after_expiry += [e["t"] - expired_at for e in joined]
        self.participants = ids
        progress(
            f"members={self.members} poll={self.label}: leave {len(self.expiry)}, round "
            f"complete at every member {max(self.rejoin[-len(joined) :]):.2f} s after it"
        )

    def run(self, reps: int) -> dict[str, str]:
        first_round_s = self.first_round()
        time.sleep(1.0)  # every member's monitor loop and heartbeats in their stride
        self.train.begin()
        time.sleep(2.0)
        self.train.end()
        rng = random.Random(self.members)
        victim = -1
        for rep in range(reps):
            if rep:
                self.add_spare(self.members + rep - 1, self.placed[victim])
                time.sleep(1.0)
            victim = rng.choice(sorted(self.participants))
            self.leave(victim)
            time.sleep(1.0)
        self.pool.broadcast({"cmd": "stop"})
        self.pool.expect("stopped", len(self.pool.procs), "stop")
        rejoin, after_expiry = sorted(self.rejoin), sorted(self.after_expiry)
        return {
            "members": str(self.members),
            "poll": self.label,
            "round_members": str(self.nodes),
            "first_round_s": f"{first_round_s:.2f}",
            "rejoin_round_s_p50": f"{statistics.median(rejoin):.2f}",
            "rejoin_round_s_max": f"{rejoin[-1]:.2f}",
            "after_expiry_s_p50": f"{statistics.median(after_expiry):.2f}",
            "after_expiry_s_max": f"{after_expiry[-1]:.2f}",
            "expiry_s_mean": f"{statistics.mean(self.expiry):.2f}",
            "reps": str(reps),
            **self.leaves.summary(""),
            **self.train.summary("train_"),
        }


def poll_label(poll_s: float) -> str:
    if poll_s >= rdzv_fix.TORCH_POLL_S:
        return f"torch({poll_s:g}s)"
    return f"slurmft({poll_s:g}s)"


def interrupted(*_: Any) -> None:
    raise KeyboardInterrupt


def parse_list(text: str, kind: type) -> list[Any]:
    return [kind(part) for part in text.split(",") if part]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--members", default="32,64,128,256", help="member counts (comma list)")
    parser.add_argument("--processes", type=int, default=8, help="worker processes per poll")
    parser.add_argument("--per-process", type=int, default=32, help="most members a process")
    parser.add_argument("--polls", default="0.1,1", help="state polls in seconds (comma list)")
    parser.add_argument("--reps", type=int, default=3, help="leaves per setting")
    parser.add_argument("--timeout-s", type=float, default=300, help="bound of every wait")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="32 members on 2 processes, one leave (the test's size)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--poll", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return args
    if args.quick:
        args.members, args.processes, args.per_process, args.reps = "32", 2, 16, 1
    args.members = parse_list(args.members, int)
    args.polls = parse_list(args.polls, float)
    if min(args.members) < 3 or max(args.members) > args.processes * args.per_process:
        parser.error(f"members must be 3 to {args.processes} x {args.per_process}")
    if not all(0 < p <= rdzv_fix.TORCH_POLL_S for p in args.polls):
        parser.error("each poll must be in (0, 1] s")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def start_pool(args: argparse.Namespace, port: int, poll_s: float, log_dir: Path) -> Pool:
    pool = Pool(args.processes, port, poll_s, log_dir, args.timeout_s)
    try:
        hellos = pool.expect("hello", args.processes, "workers importing torch")
    except BenchError:
        pool.close()
        raise
    if any(abs(e["poll_s"] - poll_s) > 1e-9 for _, e in hellos):
        pool.close()
        raise BenchError(f"a worker polls at {hellos}, not {poll_s}")
    return pool


def run_all(args: argparse.Namespace, port: int, log_dir: Path) -> int:
    """Settings that failed (each reported on its line)."""
    supervisor = StoreSupervisor(LOOPBACK, port, python=sys.executable)
    pools: dict[float, Pool] = {}
    pinger = Pinger(port)
    failed = 0
    try:
        supervisor.start()
        assert supervisor.process is not None
        store_pid = supervisor.process.pid
        for poll_s in args.polls:
            pools[poll_s] = start_pool(args, port, poll_s, log_dir)
        for members in args.members:
            for poll_s in args.polls:  # interleaved: load from others hits both
                label = poll_label(poll_s)
                setting = Setting(pools[poll_s], members, label, store_pid, pinger)
                try:
                    result = setting.run(args.reps)
                except BenchError as error:
                    # Reported, and the next setting gets fresh workers: this one's members may
                    # still be polling the store.
                    progress(f"members={members} poll={label} failed: {error}")
                    state = pools[poll_s].inspect() or "unknown"
                    result = {
                        "members": str(members),
                        "poll": label,
                        "failed": "yes",
                        "where": str(error).split(":")[0].replace(" ", "_"),
                        "state": state,
                    }
                    failed += 1
                    pools.pop(poll_s).close()
                    pools[poll_s] = start_pool(args, port, poll_s, log_dir)
                if supervisor.stats.restarts:
                    raise BenchError("the store supervisor restarted the store (unanswered)")
                result["supervisor_failed_pings"] = str(supervisor.stats.failed_pings)
                print(
                    "rendezvous_scale " + " ".join(f"{k}={v}" for k, v in result.items()),
                    flush=True,
                )
        return failed
    finally:
        pinger.close()
        for pool in pools.values():
            pool.close()
        supervisor.stop()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args.port, args.poll)
        return
    # SIGTERM ends the run as Ctrl-C does: through the clean-up in run_all.
    signal.signal(signal.SIGTERM, interrupted)
    log_dir = Path(tempfile.mkdtemp(prefix="rendezvous-scale-"))
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port = int(probe.getsockname()[1])
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        if run_all(args, port, log_dir):
            sys.exit(1)
    except BenchError as error:
        print(f"rendezvous_scale failed: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for log in log_dir.iterdir():
            log.unlink()
        log_dir.rmdir()


if __name__ == "__main__":
    main()
