"""`slurmft daemon`: the long-running controller on the login node.

APScheduler 3 runs the periodic jobs (in-memory job store, rebuilt from the config at every
start; ``coalesce`` and ``max_instances=1`` so a slow pass is never run twice at once):

- *control* (every ``daemon.poll_interval_s``): observe (one batched Slurm query for all tracked
  jobs, one for the nodes) → decide (pure) → act (recorded). Slurm or the store unreachable:
  the pass is skipped and retried next time; nothing is decided on stale information.
- *retention* (every 5 minutes): raw step times folded into per-minute aggregates, sampled
  heartbeats past their window deleted.

Two servers run beside the scheduler: the agents' HTTP endpoint and the CLI's unix socket.
Everything the daemon knows lives in the store, so a restart (or a SIGKILL) loses nothing:
agents resend what was not acknowledged, and the next pass reconciles with Slurm.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from types import FrameType

from apscheduler.schedulers.background import BackgroundScheduler

from slurmft.config import Config, ConfigError
from slurmft.controller.act import Executor
from slurmft.controller.decide import Policy, decide
from slurmft.controller.http import IngestServer
from slurmft.controller.observe import gather
from slurmft.controller.rpc import SOCKET_NAME, RpcServer
from slurmft.controller.user_ops import operations
from slurmft.db import Database, DatabaseUnavailable
from slurmft.db.retention import fold_step_times, prune_heartbeat_samples
from slurmft.slurm import CliSlurmClient, SlurmClient

log = logging.getLogger(__name__)

RETENTION_INTERVAL_S = 300.0


def _host_port(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{key} = {value!r}: expected host:port, e.g. 127.0.0.1:8787")
    return host.strip("[]"), int(port)


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        database: Database | None = None,
        slurm: SlurmClient | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.config = config
        self.database = database or Database.from_config(config)
        self.slurm = slurm or CliSlurmClient(
            slurm_conf=config["slurm.conf"] or None, timeout_s=config["slurm.command_timeout_s"]
        )
        self.policy = Policy.from_config(config)
        self.executor = Executor(
            self.database, self.slurm, observe_only=config["daemon.observe_only"]
        )
        self.clock = clock
        self.passes = 0
        self.last_pass_at: datetime | None = None
        self._stopped = threading.Event()
        self._scheduler = BackgroundScheduler(
            timezone=UTC,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30},
        )
        self._ingest: IngestServer | None = None
        self._rpc: RpcServer | None = None

    # --- the periodic jobs ------------------------------------------------------------------

    def control_pass(self) -> int:
        """One observe → decide → act pass; returns the number of actions taken."""
        try:
            with self.database.session() as session:
                view = gather(
                    session,
                    self.slurm,
                    now=self.clock(),
                    max_restarts=self.config["policy.max_restarts_without_progress"],
                    lemon_min_runs=self.config["trust.lemon_min_runs"],
                )
        except DatabaseUnavailable as exc:
            log.warning("control pass skipped: %s", exc)
            return 0
        if not view.slurm_reachable:
            log.warning("control pass skipped: Slurm unreachable; nothing decided")
            return 0
        actions = decide(view, self.policy)
        self.executor.execute(actions)
        self.passes += 1
        self.last_pass_at = self.clock()
        return len(actions)

    def retention_pass(self) -> None:
        now = self.clock()
        raw_window = timedelta(hours=self.config["retention.step_times_raw_hours"])
        samples_window = timedelta(hours=self.config["retention.heartbeat_history_hours"])
        try:
            with self.database.session() as session:
                folded = fold_step_times(session, now - raw_window)
                pruned = prune_heartbeat_samples(session, now - samples_window)
        except DatabaseUnavailable as exc:
            log.warning("retention pass skipped: %s", exc)
            return
        if folded or pruned:
            log.info("retention: folded %d step times, pruned %d heartbeat samples", folded, pruned)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> Daemon:
        """Check the schema, open the endpoints, schedule the jobs. Refuses an old schema."""
        self.database.require_current()
        host, port = _host_port(self.config["daemon.ingest_listen"], "daemon.ingest_listen")
        self._ingest = IngestServer(
            self.database,
            host,
            port,
            sample_every=timedelta(seconds=self.config["retention.heartbeat_sample_s"]),
            clock=self.clock,
        ).start()
        self._rpc = RpcServer(
            self.config.runtime_dir / SOCKET_NAME, operations(self.database)
        ).start()
        interval = self.config["daemon.poll_interval_s"]
        self._scheduler.add_job(
            self.control_pass,
            "interval",
            seconds=interval,
            id="control",
            next_run_time=self.clock(),
        )
        self._scheduler.add_job(
            self.retention_pass, "interval", seconds=RETENTION_INTERVAL_S, id="retention"
        )
        self._scheduler.start()
        log.info(
            "slurmft daemon up: store %s, ingest %s, socket %s, every %.1fs%s",
            self.database.describe(),
            self._ingest.url,
            self._rpc.path,
            interval,
            " (observe-only)" if self.config["daemon.observe_only"] else "",
        )
        return self

    @property
    def ingest_url(self) -> str:
        assert self._ingest is not None, "start() first"
        return self._ingest.url

    def stop(self) -> None:
        self._stopped.set()
        if self._scheduler.running:
            self._scheduler.shutdown(wait=True)
        for server in (self._ingest, self._rpc):
            if server is not None:
                server.stop()
        self.database.dispose()

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT (systemd stops the service with SIGTERM)."""

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %s: stopping", signal.Signals(signum).name)
            self._stopped.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal)
        self.start()
        try:
            self._stopped.wait()
        finally:
            self.stop()
