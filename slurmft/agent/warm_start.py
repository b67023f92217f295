"""A worker started warm: torchrun runs this client where it would run the script, and the node's
zygote (slurmft.agent.zygote), which imported torch and the script's imports once, forks the
worker.

    python -u -m slurmft.agent.warm_start train.py ARGS      (or: ... -m pkg.train ARGS)

torchrun sees this client as the worker: it gets the worker's exit status (a signal as the same
signal), and the signals torchrun sends it (SIGTERM to its process group on a stop) go on to the
worker's process group. The worker gets the client's standard streams, environment, working
directory and arguments, so it runs as the script would have. SIGUSR1/USR2 are not forwarded:
Slurm's `scancel --signal` and the agent's stack dumps reach the worker itself.

When there is no zygote (none configured, not ready within READY_TIMEOUT_S, refused, or gone
before it forked), the client replaces itself with `python -u train.py ARGS`: a cold start, as
without warm workers. Standard library only, and nothing imported that the cold start would
import again: the client is the whole cost of a warm start besides the fork.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ZYGOTE_SOCKET_ENV = "SLURMFT_ZYGOTE_SOCKET"
# Set in a worker the zygote forked: the zygote's pid (tests and curious scripts read it).
WARM_START_ENV = "SLURMFT_WARM_START"
# How long a worker waits for the zygote's fork: its imports (2-3 s here) run while the first
# round forms. A zygote stuck in an import must not keep the run from starting.
READY_TIMEOUT_S = 120.0
HEADER = struct.Struct(">I")
STREAMS = (0, 1, 2)
# What torchrun sends a worker to stop it, and what a terminal or Slurm may send.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
PREFIX = "slurmft warm start:"


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module (`-m`), with its arguments."""

    name: str
    module: bool
    args: tuple[str, ...]

    def python_argv(self) -> list[str]:
        return ["-m", self.name, *self.args] if self.module else [self.name, *self.args]

    def search_root(self, cwd: str) -> str:
        """`sys.path[0]` as `python` sets it: the script's folder, or the cwd for `-m`."""
        return cwd if self.module else str(Path(cwd, self.name).resolve().parent)


def parse_target(argv: list[str]) -> Target:
    if argv[:1] == ["-m"] and len(argv) >= 2:
        return Target(argv[1], True, tuple(argv[2:]))
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"{PREFIX} usage: python -m slurmft.agent.warm_start SCRIPT|-m MODULE ...")
    return Target(argv[0], False, tuple(argv[1:]))


def survive_rank_signals() -> None:
    """`scancel --signal=USR1` (and `srun` forwarding) reaches every process of the step under
    proctrack/linuxproc (torchrun, the zygote, these clients), whose default action for
    USR1/USR2 is to die: the workers would then train on as orphans out of Slurm's sight, or
    lose their client. A Python handler (unlike SIG_IGN) is reset at exec, so the workers still
    get the default or their own handlers; the worker gets its own copy of the signal."""
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, lambda *_: None)


def signal_group(pid: int, signum: int) -> None:
    """Signal a worker's process group (it leads its own session, as under torchrun), or the
    worker alone when it has none yet; a worker already gone is no error."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


class Unavailable(Exception):
    """No warm worker this time; the client starts the script cold."""


def encode_request(target: Target) -> bytes:
    body = json.dumps(
        {
            "name": target.name,
            "module": target.module,
            "args": list(target.args),
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            # torchrun's NUMA binding (numactl) or a site's pinning applies to this client.
            "cpus": sorted(os.sched_getaffinity(0)),
        }
    ).encode()
    return HEADER.pack(len(body)) + body


def send_reply(conn: socket.socket, reply: dict[str, Any]) -> None:
    conn.sendall(json.dumps(reply).encode() + b"\n")


class Forwarder:
    """Passes stop signals on to the worker's process group once its pid is known; a signal
    that comes before is held and passed on then."""

    def __init__(self) -> None:
        self.pid = 0
        self.pending: list[int] = []
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, self._handle)
        survive_rank_signals()

    def _handle(self, signum: int, _frame: object) -> None:
        if self.pid:
            signal_group(self.pid, signum)
        else:
            self.pending.append(signum)

    def started(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            signal_group(pid, signum)


def run_forked(
    path: str, target: Target, forwarder: Forwarder, ready_timeout_s: float = READY_TIMEOUT_S
) -> int:
    """Have the zygote fork the worker; returns its exit code (a negative signal number).
    Raises Unavailable while nothing was forked."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = encode_request(target)
        socket.send_fds(conn, [request[: HEADER.size]], list(STREAMS))
        conn.sendall(request[HEADER.size :])
        conn.settimeout(ready_timeout_s)
        replies = conn.makefile("rb")
        try:
            first = replies.readline()
        except TimeoutError as error:
            raise Unavailable(f"the zygote did not fork within {ready_timeout_s:g} s") from error
    except OSError as error:
        conn.close()
        raise Unavailable(f"no zygote at {path} ({error})") from error
    if not first:
        raise Unavailable("the zygote closed the connection before it forked")
    reply = json.loads(first)
    if "refused" in reply:
        raise Unavailable(f"the zygote refused: {reply['refused']}")
    forwarder.started(int(reply["pid"]))
    conn.settimeout(None)
    last = replies.readline()
    if not last:  # the zygote died: so does its worker (its parent-death signal); make sure
        signal_group(forwarder.pid, signal.SIGKILL)
        print(f"{PREFIX} the zygote died while worker {forwarder.pid} ran", file=sys.stderr)
        return 1
    return os.waitstatus_to_exitcode(int(json.loads(last)["status"]))


def cold_start(target: Target) -> None:
    python = sys.executable
    os.execv(python, [python, "-u", *target.python_argv()])


def exit_like(code: int) -> int:
    """A worker killed by a signal: this client dies of the same signal, so torchrun sees it."""
    if code >= 0:
        return code
    with contextlib.suppress(OSError, ValueError):  # SIGKILL's action cannot be set
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    return 128 - code  # not reached: the signal's default action ends this process


def main(argv: list[str] | None = None) -> int:
    target = parse_target(sys.argv[1:] if argv is None else argv)
    path = os.environ.get(ZYGOTE_SOCKET_ENV, "")
    if path:
        forwarder = Forwarder()
        try:
            return exit_like(run_forked(path, target, forwarder))
        except Unavailable as why:
            print(f"{PREFIX} {why}; starting the worker cold", file=sys.stderr, flush=True)
        if forwarder.pending:  # told to stop before any worker started: stop
            return exit_like(-forwarder.pending[0])
    cold_start(target)
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main())
