"""Is the daemon doing its job? The main loop's liveness, ``/healthz`` and the ``/metrics`` server.

One judgement feeds both the systemd watchdog and ``/healthz``: the main loop is alive while a
control pass has ended (completed, or skipped because Slurm or the store was away) within
``daemon.stuck_after_passes`` poll intervals. A pass that blocks (a hung NFS read, a wedged
lock) stops the watchdog pings, so systemd restarts the daemon, and turns ``/healthz`` red.
Slurm being unreachable is reported but is not unhealthy: restarting the daemon cannot fix it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import text

from slurmft.controller.bounded import (
    BoundedHTTPHandler,
    BoundedServer,
    Connection,
    HttpProtocol,
    ServerLimits,
    tcp_listener,
)
from slurmft.controller.pass_health import held_runs
from slurmft.db import Database

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"
# A scraper and a probe or two: a handful of threads, whatever connects.
OPS_LIMITS = ServerLimits(
    max_connections=64, workers=4, header_timeout_s=10.0, body_timeout_s=30.0, idle_timeout_s=5.0
)


class LoopLiveness:
    """When the main loop last finished a pass (monotonic clock), and whether that is too long
    ago. Before the first pass, the daemon's start counts as one."""

    def __init__(self, stuck_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stuck_after_s = stuck_after_s
        self._clock = clock
        self._last = clock()
        self.slurm_reachable: bool | None = None  # None: not polled yet

    def tick(self, *, slurm_reachable: bool | None = None) -> None:
        self._last = self._clock()
        if slurm_reachable is not None:
            self.slurm_reachable = slurm_reachable

    def seconds_since_pass(self) -> float:
        return self._clock() - self._last

    def alive(self) -> bool:
        return self.seconds_since_pass() <= self.stuck_after_s


@dataclass(frozen=True)
class Health:
    ok: bool
    checks: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"ok": self.ok, **self.checks}).encode()


def store_reachable(database: Database) -> tuple[bool, str]:
    try:
        with database.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any failure to answer is "unreachable" to a health check
        return False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return True, "ok"


def held_run_ids(database: Database, shown: int = 20) -> list[str] | str:
    """The live runs held (controller.pass_health), the first ``shown``; or why they could not
    be read. A held run is one run's trouble: it does not make the daemon unhealthy."""
    try:
        with database.session() as session:
            return [run.id for run in held_runs(session)[:shown]]
    except Exception as exc:  # the store's own check says what is wrong with it
        return f"not read: {type(exc).__name__}"


def check_health(liveness: LoopLiveness, database: Database) -> Health:
    store_ok, store_detail = store_reachable(database)
    since = liveness.seconds_since_pass()
    loop_ok = liveness.alive()
    return Health(
        ok=store_ok and loop_ok,
        checks={
            "loop": "ok" if loop_ok else "stuck",
            "seconds_since_pass": round(since, 3),
            "stuck_after_s": liveness.stuck_after_s,
            "store": store_detail,
            "slurm": {None: "not polled yet", True: "ok", False: "unreachable"}[
                liveness.slurm_reachable
            ],
            "held_runs": held_run_ids(database) if store_ok else "not read: store unreachable",
        },
    )


class OpsServer:
    """``/metrics`` (Prometheus text format) and ``/healthz`` (JSON; 200 or 503) on one port."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Callable[[], Health],
        host: str,
        port: int,
        *,
        limits: ServerLimits = OPS_LIMITS,
        on_refusal: Callable[[str, Connection], None] | None = None,
    ) -> None:
        handler = type(
            "OpsHandler",
            (_OpsHandler,),
            {"registry": registry, "health": staticmethod(health)},
        )
        self.server = BoundedServer(
            tcp_listener(host, port),
            HttpProtocol(handler),
            limits,
            "slurmft-metrics",
            on_refusal=on_refusal,
        )

    @property
    def url(self) -> str:
        host, port = self.server.listener.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> OpsServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


class _OpsHandler(BoundedHTTPHandler):
    registry: CollectorRegistry
    health: Callable[[], Health]

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics %s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == METRICS_PATH:
            self._reply(HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(self.registry))
        elif path == HEALTH_PATH:
            health = self.health()
            status = HTTPStatus.OK if health.ok else HTTPStatus.SERVICE_UNAVAILABLE
            self._reply(status, "application/json", health.to_json())
        else:
            body = json.dumps({"error": f"no such path {path}; try {METRICS_PATH}"}).encode()
            self._reply(HTTPStatus.NOT_FOUND, "application/json", body)

    def _reply(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
