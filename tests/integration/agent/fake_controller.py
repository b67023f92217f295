"""A stand-in for the daemon's ingest endpoint: records every batch, answers with commands."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from slurmft.protocol import BATCH_PATH, TIME_PATH, AgentBatch, BatchReply, Command, TimeReply


class FakeController(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, commands_for: Callable[[AgentBatch], list[Command]] = lambda b: []):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.commands_for = commands_for
        self.batches: list[AgentBatch] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> FakeController:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def received(self) -> list[AgentBatch]:
        with self._lock:
            return list(self.batches)

    def record(self, batch: AgentBatch) -> None:
        with self._lock:
            self.batches.append(batch)


class _Handler(BaseHTTPRequestHandler):
    server: FakeController

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        assert self.path == TIME_PATH
        self._reply(TimeReply(time.time()).to_json())

    def do_POST(self) -> None:
        assert self.path == BATCH_PATH
        batch = AgentBatch.from_json(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.record(batch)
        commands = tuple(self.server.commands_for(batch))
        self._reply(BatchReply(batch.seq, time.time(), commands).to_json())
