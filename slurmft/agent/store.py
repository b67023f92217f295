"""The standalone rendezvous store and its supervisor (run by the batch step on node 0).

Every agent runs torchrun with `is_host=false` against this store, so losing any training node
(rank 0's included) leaves the store up. The store itself is then the single point of failure
(notes/torchrun.md): killed, every agent exits; *frozen* (SIGSTOP), agents block silently for
minutes. So the supervisor pings it every second over TCPStore's own protocol and restarts a
server that is dead or does not answer within a timeout.

The store is unauthenticated and unpickles what it reads: bind it to the job's network only.
torch is imported only by the server process (`python -m slurmft.agent.store`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# TCPStore wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): a client first sends
# VALIDATE with a magic number; PING echoes a 32-bit nonce. Native byte order (little endian).
_QUERY_VALIDATE = 0
_QUERY_PING = 13
_VALIDATION_MAGIC = 0x3C85F7CE
READY_LINE = "slurmft-store ready"


def check_store_host(host: str) -> str:
    """``host``, which the store will listen on: refused (ValueError) when it is, or resolves to,
    every interface's address (0.0.0.0, ::), which would expose the store to every network
    the node is on instead of the job's (docs/install.md, "Security model")."""
    if not host:
        raise ValueError("the rendezvous store needs the job network's address, not every one")
    try:
        found = {
            str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        }
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(
            f"cannot resolve the rendezvous store's address {host!r}: {error}"
        ) from None
    wildcard = sorted(a for a in found if ipaddress.ip_address(a.split("%")[0]).is_unspecified)
    if wildcard:
        raise ValueError(
            f"the rendezvous store must not listen on every interface ({host!r} is "
            f"{', '.join(wildcard)}): give this node's address on the job network"
        )
    return host


def ping_store(host: str, port: int, timeout_s: float = 2.0) -> float:
    """Round trip of one PING in seconds; raises OSError when the store is down or frozen."""
    started = time.monotonic()
    nonce = int(started * 1000) & 0xFFFFFFFF
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.sendall(struct.pack("<BI", _QUERY_VALIDATE, _VALIDATION_MAGIC))
        conn.sendall(struct.pack("<BI", _QUERY_PING, nonce))
        reply = b""
        while len(reply) < 4:
            chunk = conn.recv(4 - len(reply))
            if not chunk:
                raise ConnectionError("store closed the connection")
            reply += chunk
    (echo,) = struct.unpack("<I", reply)
    if echo != nonce:
        raise ConnectionError(f"store answered {echo} to ping {nonce}")
    return time.monotonic() - started


def serve(host: str, port: int) -> None:
    """Host a TCPStore until killed (the server process's main)."""
    from torch.distributed import TCPStore  # noqa: TID251 (the store's own process)

    # TCPStore alone listens on every interface; a socket we bind keeps it on the job network.
    check_store_host(host)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    store = TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        use_libuv=True,
        master_listen_fd=listener.fileno(),
    )
    print(READY_LINE, store.port, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()


@dataclass
class SupervisorStats:
    restarts: int = 0
    failed_pings: int = 0


class StoreSupervisor:
    """Runs the store server as a child process and keeps it answering.

    `start()` returns once the store answers a ping. A background thread pings it every
    `interval_s`; `unhealthy_after` failed pings in a row (dead, or frozen past `ping_timeout_s`)
    kill the server and start a new one on the same port. The rendezvous state is lost with it:
    agents blocked on the old store fail and their torchrun restarts against the new one.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        python: str = sys.executable,
        interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
        unhealthy_after: int = 2,
        start_timeout_s: float = 60.0,
    ):
        self.host, self.port, self.python = check_store_host(host), port, python
        self.interval_s, self.ping_timeout_s = interval_s, ping_timeout_s
        self.unhealthy_after, self.start_timeout_s = unhealthy_after, start_timeout_s
        self.stats = SupervisorStats()
        self.process: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _spawn(self) -> None:
        argv = [self.python, "-m", "slurmft.agent.store", "--host", self.host]
        self.process = subprocess.Popen([*argv, "--port", str(self.port)])
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._stop.is_set():
                return  # stop() ends what was started here
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the rendezvous store on {self.endpoint} exited with "
                    f"{self.process.returncode} at start (port in use?)"
                )
            try:
                ping_store(self.host, self.port, self.ping_timeout_s)
                return
            except OSError:
                time.sleep(0.1)
        self._kill()
        raise RuntimeError(f"the rendezvous store on {self.endpoint} did not start in time")

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def start(self) -> StoreSupervisor:
        self._spawn()
        self._thread = threading.Thread(target=self._watch, name="store-supervisor", daemon=True)
        self._thread.start()
        return self

    def healthy(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            ping_store(self.host, self.port, self.ping_timeout_s)
        except OSError:
            return False
        return True

    def _watch(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            if self.healthy():
                failures = 0
                continue
            failures += 1
            self.stats.failed_pings += 1
            dead = self.process is None or self.process.poll() is not None
            if dead or failures >= self.unhealthy_after:
                log.warning(
                    "rendezvous store %s %s: restarting it",
                    self.endpoint,
                    "died" if dead else "does not answer",
                )
                self._restart()
                failures = 0

    def _restart(self) -> None:
        self._kill()
        self.stats.restarts += 1
        try:
            self._spawn()
        except RuntimeError as error:
            log.error("%s", error)  # the next round of the watch loop tries again

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # Not bounded by a timeout: a restart in flight would otherwise put a new store in
            # self.process after the one below was stopped, and leave it running. The watch
            # loop ends within one ping (ping_timeout_s), a start at its next poll.
            self._thread.join()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slurmft.agent.store")
    parser.add_argument("--host", required=True, help="the job network's address, never 0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
