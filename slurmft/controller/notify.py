"""The systemd notify protocol (sd_notify), stdlib only.

A message is one datagram of ``KEY=value`` lines to the unix socket named by ``$NOTIFY_SOCKET``
(a path, or an abstract socket when it starts with ``@``). Without the variable every call is a
no-op, so the daemon behaves the same in a terminal, in a test and under systemd. Failures to
send are logged, never raised: a lost notification must not take the daemon down.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

# systemd's guidance: ping at half the watchdog interval or more often. Under half leaves room
# for a scheduler tick that runs late.
WATCHDOG_FRACTION = 0.4


def _address(notify_socket: str) -> str | bytes:
    if notify_socket.startswith("@"):
        return b"\0" + notify_socket[1:].encode()  # abstract namespace
    return notify_socket


def send(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send one notification; False when there is no socket to send to or sending failed."""
    env = os.environ if environ is None else environ
    target = env.get("NOTIFY_SOCKET", "")
    if not target:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(_address(target))
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("systemd notification %r to %s failed: %s", message, target, exc)
        return False
    return True


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """How often to send WATCHDOG=1, or None when systemd asked for no watchdog (or asked
    another process: WATCHDOG_PID names the process the watchdog is for)."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6 * WATCHDOG_FRACTION


class Notifier:
    """The daemon's side of Type=notify: READY once, WATCHDOG while alive, STOPPING at the end."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        self._ready_lock = threading.Lock()
        # Set only once READY=1 is on the socket: the watchdog job (another thread) pings once it
        # reads True, so no WATCHDOG=1 can reach systemd before READY=1.
        self.ready_sent = False

    @property
    def watchdog_interval_s(self) -> float | None:
        return watchdog_interval_s(self._environ)

    def ready(self, status: str = "") -> None:
        with self._ready_lock:
            if self.ready_sent:
                return
            send("READY=1" + (f"\nSTATUS={status}" if status else ""), self._environ)
            self.ready_sent = True

    def status(self, text: str) -> None:
        send(f"STATUS={text}", self._environ)

    def watchdog(self) -> None:
        send("WATCHDOG=1", self._environ)

    def stopping(self) -> None:
        send("STOPPING=1", self._environ)
