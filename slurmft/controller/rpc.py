"""The CLI ↔ daemon channel: one JSON request and one JSON reply per connection on a unix socket.

Who is asking comes from the kernel, not from the request: the daemon reads the caller's uid from
the socket's peer credentials (SO_PEERCRED), so a user sees and acts on their own runs only
(root sees all). The socket itself is open to every local user for exactly that reason.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slurmft.controller.serving import ServerThread
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


class _Handler(socketserver.StreamRequestHandler):
    operations: Mapping[str, Operation]

    def handle(self) -> None:
        try:
            uid = peer_uid(self.request)
            request = _read_request(self.rfile)
            operation = self.operations.get(request["op"])
            if operation is None:
                raise RpcError(f"unknown operation {request['op']!r}")
            reply: dict[str, Any] = {"ok": True, "result": operation(uid, request["args"])}
        except SlurmftError as exc:
            reply = {"ok": False, "error": str(exc)}
        except Exception:
            log.exception("rpc request failed")
            reply = {"ok": False, "error": "internal error in the daemon; see its log"}
        self.wfile.write(json.dumps(reply, default=str).encode() + b"\n")


def _read_request(rfile: Any) -> dict[str, Any]:
    line = rfile.readline(MAX_REQUEST_BYTES + 1)
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
    """Serves ``operations`` on a unix socket in a background thread."""

    def __init__(self, socket_path: Path, operations: Mapping[str, Operation]) -> None:
        if not socket_path.parent.exists():
            socket_path.parent.mkdir(parents=True)
            # Made here (not by systemd's RuntimeDirectory): searchable by every user whatever
            # the daemon's umask, or their CLI could not reach the socket.
            socket_path.parent.chmod(0o755)
        socket_path.unlink(missing_ok=True)  # a stale socket from a previous daemon
        handler = type("Handler", (_Handler,), {"operations": dict(operations)})
        self.path = socket_path
        self._server = socketserver.ThreadingUnixStreamServer(str(socket_path), handler)
        self._server.daemon_threads = True
        # Every local user may connect: authorization is by peer uid, per request.
        os.chmod(socket_path, 0o666)
        self._thread = ServerThread(self._server, "slurmft-rpc")

    def start(self) -> RpcServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._thread.stop()
        self.path.unlink(missing_ok=True)


def call(socket_path: Path, op: str, timeout_s: float = 30.0, **args: Any) -> Any:
    """Ask the daemon; its refusals raise RpcError, its absence DaemonUnreachable."""
    request = json.dumps({"v": RPC_VERSION, "op": op, "args": args}).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(socket_path))
            sock.sendall(request)
            reply = json.loads(sock.makefile("rb").readline())
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
