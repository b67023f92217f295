"""Serving a socketserver (HTTP or unix socket) from a daemon thread, stopped cleanly."""

from __future__ import annotations

import socketserver
import threading


class ServerThread:
    """Runs ``server.serve_forever`` on its own thread until ``stop``."""

    def __init__(self, server: socketserver.BaseServer, name: str) -> None:
        self.server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name=name, kwargs={"poll_interval": 0.2}, daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
