"""The CLI ↔ daemon channel: one JSON request and one JSON reply per connection on a unix socket.

Who is asking comes from the kernel, not from the request: the daemon reads the caller's uid from
the socket's peer credentials (SO_PEERCRED), so a user sees and acts on their own runs only
(root sees all). The socket itself is open to every local user for exactly that reason.

The socket is served by ``BoundedServer`` (controller.bounded): the request line must arrive
within ``daemon.header_timeout_s``, at most ``daemon.socket_max_connections`` connections are
held (past that the CLI is told to retry), and ``daemon.socket_workers`` threads answer them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slurmft.controller.bounded import BoundedServer, Connection, Reason, ServerLimits
from slurmft.errors import SlurmftError

log = logging.getLogger(__name__)

RPC_VERSION = 1
MAX_REQUEST_BYTES = 64 * 1024
SOCKET_NAME = "slurmft.sock"


class RpcError(SlurmftError):
    """A request the daemon answered with an error; the message is for the user."""


class DaemonUnreachable(SlurmftError):
    pass


# An operation: (caller uid, arguments) -> JSON-able result. Raise RpcError to refuse.
Operation = Callable[[int, Mapping[str, Any]], Any]


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket, as the kernel reports it."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


# The defaults of daemon.socket_* and daemon.*_timeout_s (slurmft.config).
DEFAULT_LIMITS = ServerLimits(
    max_connections=2048,
    workers=16,
    header_timeout_s=10.0,
    body_timeout_s=30.0,
    idle_timeout_s=5.0,
    max_head_bytes=MAX_REQUEST_BYTES,
    max_per_caller=128,
)


def _reply_line(reply: Mapping[str, Any]) -> bytes:
    return json.dumps(reply, default=str).encode() + b"\n"


class _RpcProtocol:
    """One JSON line in, one JSON line out; the caller's uid from the kernel at accept."""

    def __init__(self, operations: Mapping[str, Operation]) -> None:
        self.operations = operations

    def accepted(self, conn: Connection) -> None:
        conn.caller["uid"] = peer_uid(conn.sock)

    def head_complete(self, buffer: bytearray) -> bool:
        return b"\n" in buffer

    def refusal(self, reason: str, limits: ServerLimits) -> bytes:
        error = {
            Reason.OVER_CAPACITY: f"the daemon is busy ({limits.max_connections} requests open):"
            " retry in a moment",
            Reason.OVER_CALLER_CAP: f"you have {limits.max_per_caller} requests open to the "
            "daemon already: let them finish, then retry",
            Reason.HEADER_TIMEOUT: f"the request did not arrive within "
            f"{limits.header_timeout_s:g}s",
            Reason.IDLE_TIMEOUT: f"nothing was sent for {limits.idle_timeout_s:g}s",
            Reason.HEAD_TOO_LARGE: "request too large",
        }.get(reason, "refused")
        return _reply_line({"ok": False, "error": error})

    def serve(self, conn: Connection) -> bool:
        try:
            request = _parse_request(bytes(conn.buffer))
            operation = self.operations.get(request["op"])
            if operation is None:
                raise RpcError(f"unknown operation {request['op']!r}")
            reply: dict[str, Any] = {
                "ok": True,
                "result": operation(conn.caller["uid"], request["args"]),
            }
        except SlurmftError as exc:
            reply = {"ok": False, "error": str(exc)}
        except Exception:
            log.exception("rpc request failed")
            reply = {"ok": False, "error": "internal error in the daemon; see its log"}
        conn.sock.sendall(_reply_line(reply))
        return False  # one request per connection


def _parse_request(data: bytes) -> dict[str, Any]:
    line = data.split(b"\n", 1)[0]
    if len(line) > MAX_REQUEST_BYTES:
        raise RpcError("request too large")
    try:
        request = json.loads(line)
    except ValueError:
        raise RpcError("request is not JSON") from None
    if not isinstance(request, dict) or request.get("v") != RPC_VERSION:
        raise RpcError("CLI and daemon run different slurmft releases: upgrade both")
    if not isinstance(request.get("op"), str) or not isinstance(request.get("args", {}), dict):
        raise RpcError("malformed request")
    request.setdefault("args", {})
    return request


class RpcServer:
    """Serves ``operations`` on a unix socket within ``limits``."""

    def __init__(
        self,
        socket_path: Path,
        operations: Mapping[str, Operation],
        *,
        limits: ServerLimits = DEFAULT_LIMITS,
        on_refusal: Callable[[str, Connection], None] | None = None,
    ) -> None:
        if not socket_path.parent.exists():
            socket_path.parent.mkdir(parents=True)
            # Made here (not by systemd's RuntimeDirectory): searchable by every user whatever
            # the daemon's umask, or their CLI could not reach the socket.
            socket_path.parent.chmod(0o755)
        socket_path.unlink(missing_ok=True)  # a stale socket from a previous daemon
        self.path = socket_path
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(socket_path))
        # Every local user may connect: authorization is by peer uid, per request.
        os.chmod(socket_path, 0o666)
        self.server = BoundedServer(
            listener, _RpcProtocol(dict(operations)), limits, "slurmft-rpc", on_refusal=on_refusal
        )

    def start(self) -> RpcServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.path.unlink(missing_ok=True)


def call(socket_path: Path, op: str, timeout_s: float = 30.0, **args: Any) -> Any:
    """Ask the daemon; its refusals raise RpcError, its absence DaemonUnreachable."""
    request = json.dumps({"v": RPC_VERSION, "op": op, "args": args}).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(socket_path))
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(request)  # a busy daemon answers, and closes, before reading it
            line = sock.makefile("rb").readline()
        if not line:
            raise DaemonUnreachable("the slurmft daemon closed the connection without answering")
        reply = json.loads(line)
    except (FileNotFoundError, ConnectionRefusedError):
        raise DaemonUnreachable(
            f"the slurmft daemon is not running (nothing listens on {socket_path}): start it "
            f"with `systemctl start slurmft` or `slurmft daemon`, or set paths.runtime_dir"
        ) from None
    except PermissionError:
        raise DaemonUnreachable(
            f"permission denied on the slurmft daemon's socket {socket_path}: its directory "
            f"must be searchable and the socket writable by every user (see docs/install.md)"
        ) from None
    except TimeoutError:
        raise DaemonUnreachable(
            f"the slurmft daemon did not answer within {timeout_s:.0f}s"
        ) from None
    if not reply.get("ok"):
        raise RpcError(reply.get("error", "the daemon refused the request"))
    return reply["result"]
