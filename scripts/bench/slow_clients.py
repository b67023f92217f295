#!/usr/bin/env python3
"""Idle and slow clients against the daemon's endpoints, with real agents reporting meanwhile.

A child process serves the daemon's ingest endpoint and CLI socket (slurmft.controller.http and
.rpc over a fresh SQLite store) with the daemon's default limits (slurmft.config.DaemonSection),
or those given. This process then holds, for --seconds:

- --idle connections to ingest and as many to the socket that send nothing (each one the server
  closes is opened again, so the count holds);
- --slow connections to each that send their request head a byte a second (opened again when
  closed);
- --agents real reporters (slurmft.agent.reporter.Reporter over HttpTransport) posting a batch a
  second (8 ranks' heartbeats and step times each), and a CLI call a second on the socket.

It prints the server's threads (before the attack and at its peak) against the configured cap
(ingest_workers + socket_workers) + 16, its RSS growth, when the slow connections were closed,
and the agents' acknowledgement latency; the last line is

    slow_clients threads_before=N threads_peak=N cap=N rss_growth_mb=X slow_closed_s=X
    ack_p50_s=X ack_p99_s=X ok=true|false
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from slurmft.agent.reporter import HttpTransport, Reporter  # noqa: E402
from slurmft.config import DaemonSection  # noqa: E402
from slurmft.protocol import BATCH_PATH, RankHeartbeat, RankStepTime  # noqa: E402

SLOW_HEAD = (
    f"POST {BATCH_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nothing\r\n".encode()
    + b"X-Pad: "
    + b"a" * 400
)
LIMIT_SETTINGS = (
    "header_timeout_s",
    "body_timeout_s",
    "idle_timeout_s",
    "ingest_max_connections",
    "ingest_workers",
    "socket_max_connections",
    "socket_workers",
    "socket_max_per_user",
)
SLOW_LINE = b'{"v": 1, "op": "runs", "args": {"pad": "' + b"a" * 400


# --- the server child ------------------------------------------------------------------------


def serve(directory: Path, settings: dict[str, float]) -> None:
    from datetime import timedelta

    from prometheus_client import CollectorRegistry, Counter

    from slurmft.controller.bounded import ServerLimits
    from slurmft.controller.http import IngestServer
    from slurmft.controller.ingest import new_run_token
    from slurmft.controller.refusals import Refusals
    from slurmft.controller.rpc import MAX_REQUEST_BYTES, RpcServer
    from slurmft.controller.user_ops import operations
    from slurmft.db import Database
    from slurmft.db.models import Run

    database = Database(f"sqlite:///{directory / 'slurmft.db'}")
    database.upgrade()
    token, digest = new_run_token()
    with database.session() as s:
        s.add(Run(id="rbench", name="bench", owner_uid=0, owner_name="root", nodes=1,
                  command=["train.py"], token_hash=digest))  # fmt: skip
    counter = Counter("refusals", "", ["server", "reason"], registry=CollectorRegistry())
    refusals = Refusals(database, counter)

    def limits(max_connections: int, workers: int, head: int, per: int = 0) -> ServerLimits:
        return ServerLimits(
            max_connections=max_connections,
            workers=workers,
            header_timeout_s=settings["header_timeout_s"],
            body_timeout_s=settings["body_timeout_s"],
            idle_timeout_s=settings["idle_timeout_s"],
            max_head_bytes=head,
            max_per_caller=per,
        )

    ingest = IngestServer(
        database,
        sample_every=timedelta(seconds=60),
        limits=limits(
            int(settings["ingest_max_connections"]), int(settings["ingest_workers"]), 64 * 1024
        ),
        on_refusal=refusals.ingest_hook,
        on_connection_refused=refusals.connection_hook("ingest"),
    ).start()
    ops = operations(database, slurm=None)  # type: ignore[arg-type]  # `runs` asks no Slurm
    rpc = RpcServer(
        directory / "s.sock",
        {"runs": ops["runs"]},
        limits=limits(
            int(settings["socket_max_connections"]),
            int(settings["socket_workers"]),
            MAX_REQUEST_BYTES,
            int(settings["socket_max_per_user"]),
        ),
        on_refusal=refusals.connection_hook("socket"),
    ).start()
    print(json.dumps({"url": ingest.url, "socket": str(rpc.path), "token": token}), flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    counts = {
        f"{s.labels['server']}/{s.labels['reason']}": s.value
        for metric in counter.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }
    print(json.dumps({"refusals": counts, "audit_rows": refusals.flush()}), flush=True)
    rpc.stop()
    ingest.stop()


# --- the attackers ---------------------------------------------------------------------------


@dataclass
class Attack:
    """Keeps ``count`` connections of one kind open against one endpoint."""

    name: str
    connect: callable  # type: ignore[valid-type]
    count: int
    payload: bytes | None  # None: idle
    opened: dict[socket.socket, tuple[float, int]] = field(default_factory=dict)
    closed_after_s: list[float] = field(default_factory=list)
    answers: dict[bytes, int] = field(default_factory=dict)
    refused_at_connect: int = 0


def tcp_connector(url: str):  # type: ignore[no-untyped-def]
    host, port = url.removeprefix("http://").split(":")

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect((host, int(port)))
        return sock

    return connect


def unix_connector(path: str):  # type: ignore[no-untyped-def]
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)  # BlockingIOError when the backlog is full: tried again
        except OSError:
            sock.close()
            raise
        return sock

    return connect


def run_attacks(attacks: list[Attack], until: float, stop: threading.Event) -> None:
    selector = selectors.DefaultSelector()
    owner: dict[socket.socket, Attack] = {}
    next_byte = time.monotonic() + 1.0
    while time.monotonic() < until and not stop.is_set():
        now = time.monotonic()
        for attack in attacks:  # top each attack up, a few hundred a tick
            for _ in range(min(200, attack.count - len(attack.opened))):
                try:
                    sock = attack.connect()
                except (BlockingIOError, ConnectionRefusedError, OSError):
                    attack.refused_at_connect += 1
                    break
                attack.opened[sock] = (now, 0)
                owner[sock] = attack
                selector.register(sock, selectors.EVENT_READ)
        for key, _ in selector.select(timeout=0.05):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            attack = owner.pop(sock)
            try:
                said = sock.recv(4096)
            except OSError:
                said = b""
            opened_at, _ = attack.opened.pop(sock)
            attack.closed_after_s.append(time.monotonic() - opened_at)
            first = said.split(b"\r\n", 1)[0][:60] or b"(closed)"
            attack.answers[first] = attack.answers.get(first, 0) + 1
            selector.unregister(sock)
            sock.close()
        if time.monotonic() >= next_byte:  # the slow ones: a byte each, once a second
            next_byte += 1.0
            for attack in attacks:
                if attack.payload is None:
                    continue
                for sock, (opened_at, sent) in list(attack.opened.items()):
                    if sent < len(attack.payload):
                        with contextlib.suppress(OSError):
                            sock.send(attack.payload[sent : sent + 1])
                        attack.opened[sock] = (opened_at, sent + 1)
    for sock in list(owner):
        selector.unregister(sock)
        sock.close()


# --- the real agents -------------------------------------------------------------------------


class TimedTransport(HttpTransport):
    latencies: list[float]
    failures: list[str]

    def send_batch(self, batch):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        try:
            reply = super().send_batch(batch)
        except Exception as exc:
            self.failures.append(str(exc)[:120])
            raise
        self.latencies.append(time.monotonic() - started)
        return reply


def feed(reporters: list[Reporter], until: float, stop: threading.Event) -> None:
    step = 0
    while time.monotonic() < until and not stop.is_set():
        step += 1
        now = time.time()
        for reporter in reporters:
            for rank in range(8):
                reporter.add(RankHeartbeat(rank=rank, local_rank=rank, phase="step", step=step,
                                           progress_age_s=0.1, deadline_s=300.0, overdue=False,
                                           sent_at=now))  # fmt: skip
                reporter.add(RankStepTime(rank=rank, step=step, compute_s=0.8, wait_s=0.1,
                                          ended_at=now))  # fmt: skip
        stop.wait(1.0)


def proc_status(pid: int) -> tuple[int, float]:
    """(threads, RSS MB) of a process."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:  # noqa: PLR0915  # a script: set up, run, print, in order
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    for name in LIMIT_SETTINGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=float,
                            default=getattr(DaemonSection, name))  # fmt: skip
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, json.loads(args.settings))
        return 0

    # Every connection is a descriptor here and in the server: raise the soft limit to the hard.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (args.idle + args.slow) + args.agents + 256
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, need)), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        print(f"need {need} descriptors, have {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}")
        return 2

    settings = {k: getattr(args, k) for k in LIMIT_SETTINGS}
    cap = int(settings["ingest_workers"] + settings["socket_workers"])
    directory = Path(tempfile.mkdtemp(prefix="sft-bench-"))
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(directory), "--settings", json.dumps(settings)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    endpoints = json.loads(child.stdout.readline())

    from slurmft.controller.rpc import call

    transports: list[TimedTransport] = []
    reporters: list[Reporter] = []
    latencies: list[float] = []
    failures: list[str] = []
    for i in range(args.agents):
        transport = TimedTransport(endpoints["url"], endpoints["token"])
        transport.latencies, transport.failures = latencies, failures
        transports.append(transport)
        reporters.append(Reporter(transport, run_id="rbench", node=f"n{i:04d}",
                                  on_command=lambda _c: None, interval_s=1.0))  # fmt: skip
    stop = threading.Event()
    warmup_s = 3.0
    until = time.monotonic() + warmup_s + args.seconds
    feeder = threading.Thread(target=feed, args=(reporters, until, stop), daemon=True)
    feeder.start()
    for reporter in reporters:
        reporter.start()
    time.sleep(warmup_s)  # the agents' steady state, before the attack
    threads_before, rss_before = proc_status(child.pid)
    cpu_before, attack_started = cpu_seconds(child.pid), time.monotonic()
    acks_before = len(latencies)

    attacks = [
        Attack("ingest idle", tcp_connector(endpoints["url"]), args.idle, None),
        Attack("ingest slow", tcp_connector(endpoints["url"]), args.slow, SLOW_HEAD),
        Attack("socket idle", unix_connector(endpoints["socket"]), args.idle, None),
        Attack("socket slow", unix_connector(endpoints["socket"]), args.slow, SLOW_LINE),
    ]
    attacker = threading.Thread(target=run_attacks, args=(attacks, until, stop), daemon=True)
    attacker.start()
    peak_threads, peak_rss = threads_before, rss_before
    cli: list[float] = []
    cli_errors: list[str] = []
    while attacker.is_alive():
        threads, rss = proc_status(child.pid)
        peak_threads, peak_rss = max(peak_threads, threads), max(peak_rss, rss)
        started = time.monotonic()
        try:
            call(Path(endpoints["socket"]), "runs", timeout_s=10)
            cli.append(time.monotonic() - started)
        except Exception as exc:
            cli_errors.append(str(exc)[:100])
        time.sleep(0.25)
    server_cpu = (cpu_seconds(child.pid) - cpu_before) / (time.monotonic() - attack_started)
    for reporter in reporters:
        reporter.stop(flush_timeout_s=2)
    stop.set()
    child.stdin.close()
    final = json.loads(child.stdout.readline() or "{}")
    child.wait(timeout=30)

    acks = latencies[acks_before:]
    print(f"server: ingest workers {settings['ingest_workers']:g}, socket workers "
          f"{settings['socket_workers']:g}, header timeout {settings['header_timeout_s']:g}s, "
          f"idle timeout {settings['idle_timeout_s']:g}s")  # fmt: skip
    print(f"server cpu: {server_cpu:.2f} cores on average during the attack "
          f"(this machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"threads: before {threads_before}, peak {peak_threads} (cap {cap} + 16 = {cap + 16})")
    print(f"rss: before {rss_before:.1f} MB, peak {peak_rss:.1f} MB, "
          f"growth {peak_rss - rss_before:.1f} MB")  # fmt: skip
    slow_closed: list[float] = []
    for attack in attacks:
        closed = attack.closed_after_s
        line = (f"{attack.name}: {len(closed)} closed by the server"
                f"{f', after {min(closed):.2f}-{max(closed):.2f}s (median {statistics.median(closed):.2f}s)' if closed else ''}"  # noqa: E501
                f"; answers {dict((k.decode(errors='replace'), v) for k, v in attack.answers.items())}")  # noqa: E501  # fmt: skip
        print(line)
        if attack.payload is not None:
            slow_closed += closed
    print(f"agents: {args.agents} posting once a second, {len(acks)} batches acknowledged "
          f"during the attack, ack p50 {quantile(acks, 0.5):.3f}s p99 {quantile(acks, 0.99):.3f}s "
          f"max {max(acks, default=float('nan')):.3f}s, {len(failures)} failed sends"
          f"{f' (e.g. {failures[0]})' if failures else ''}")  # fmt: skip
    example = f" (e.g. {cli_errors[0]})" if cli_errors else ""
    print(f"cli: {len(cli)} calls answered, p99 {quantile(cli, 0.99):.3f}s, "
          f"{len(cli_errors)} failed{example}")  # fmt: skip
    print(f"refusals: {final.get('refusals')}, audit rows {final.get('audit_rows')}")
    slow_s = statistics.median(slow_closed) if slow_closed else float("nan")
    ok = (
        peak_threads <= cap + 16
        and peak_rss - rss_before <= 50
        and bool(slow_closed)
        and all(abs(s - settings["header_timeout_s"]) < 1.0 for s in slow_closed)
        and quantile(acks, 0.99) <= 1.0
        and not failures
    )
    print(f"slow_clients threads_before={threads_before} threads_peak={peak_threads} cap={cap} "
          f"rss_growth_mb={peak_rss - rss_before:.1f} slow_closed_s={slow_s:.2f} "
          f"ack_p50_s={quantile(acks, 0.5):.3f} ack_p99_s={quantile(acks, 0.99):.3f} "
          f"ok={str(ok).lower()}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
