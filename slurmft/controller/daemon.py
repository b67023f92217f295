"""`slurmft daemon`: the long-running controller on the login node.

APScheduler 3 runs the periodic jobs (in-memory job store, rebuilt from the config at every
start; ``coalesce`` and ``max_instances=1`` so a slow pass is never run twice at once):

- *control* (every ``daemon.poll_interval_s``): observe (one batched Slurm query for all tracked
  jobs, one for the nodes) → decide (pure) → act (recorded). Slurm or the store unreachable:
  the pass is skipped and retried next time; nothing is decided on stale information.
- *retention* (every 5 minutes): raw step times folded into per-minute aggregates, sampled
  heartbeats past their window deleted.
- *webhook* (every ``notify.webhook_interval_s``, when ``notify.webhook_url`` is set): the
  "a person is needed" notices waiting in the store, sent in order (webhook.py).

Three servers run beside the scheduler: the agents' HTTP endpoint, the CLI's unix socket, and
``/metrics`` + ``/healthz`` (``daemon.metrics_listen``). Under systemd (Type=notify) the daemon
says READY once the schema is at head and the first Slurm poll succeeded, pings the watchdog
while the control loop is alive (see health.py), and says STOPPING when it is asked to stop.
Everything the daemon knows lives in the store, so a restart (or a SIGKILL) loses nothing:
agents resend what was not acknowledged, and the next pass reconciles with Slurm.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import FrameType

from apscheduler.schedulers.background import BackgroundScheduler

from slurmft.config import Config, ConfigError
from slurmft.controller import views as v
from slurmft.controller.act import Executor, Outcome
from slurmft.controller.admins import Admins
from slurmft.controller.agents_url import (
    choose_agents_url,
    is_local_address,
    is_loopback_host,
    unreachable_because,
)
from slurmft.controller.bounded import ServerLimits
from slurmft.controller.busy_jobs import BUSY_JOB_EVENTS, BusyJobs, quiet_busy_skips
from slurmft.controller.decide import Decision, Policy, decide_runs
from slurmft.controller.goodput_pass import measure_failures
from slurmft.controller.health import OPS_LIMITS, LoopLiveness, OpsServer, check_health
from slurmft.controller.http import IngestServer, server_tls
from slurmft.controller.limits import RateLimits
from slurmft.controller.metrics import SCHEDULER_EVENTS, DaemonMetrics, TimedRunner
from slurmft.controller.notify import Notifier
from slurmft.controller.observe import observe
from slurmft.controller.pass_health import PassFailures
from slurmft.controller.pass_health import settle as settle_pass
from slurmft.controller.refusals import Refusals
from slurmft.controller.resubmit import OwnerSubmitter
from slurmft.controller.rpc import MAX_REQUEST_BYTES, SOCKET_NAME, RpcServer
from slurmft.controller.step_window import StepWindows
from slurmft.controller.user_ops import RunQuota, operations
from slurmft.controller.webhook import WebhookOutbox
from slurmft.db import Database, DatabaseUnavailable
from slurmft.db.models import ActionStatus
from slurmft.db.retention import fold_minute, minutes_to_fold, prune_heartbeat_samples
from slurmft.slurm import CliSlurmClient, SlurmClient
from slurmft.slurm.api import SlurmError
from slurmft.slurm.lost_sightings import LostSightings
from slurmft.slurm.runner import SubprocessRunner

log = logging.getLogger(__name__)

RETENTION_INTERVAL_S = 300.0
# How long a stop waits for the control pass in flight once its Slurm commands are ended: the
# rest of a pass is the store's (milliseconds); past it the daemon exits without the pass.
STOP_GRACE_S = 10.0
RETENTION_MINUTES_PER_PASS = 60  # (run, minute) folds; each is its own transaction
GOODPUT_INTERVAL_S = 10.0  # a failure's cost is known within this of training being back
REFUSAL_AUDIT_INTERVAL_S = 2.0


# CPython's cyclic collector runs a young collection every 700 net allocations. A control pass
# for a large run allocates hundreds of thousands of short-lived rows and tuples, so it ran
# collections hundreds of times a pass, the older ones walking the held straggler window:
# 0.1-0.15 s of a 1-s pass at 16,384 ranks (scripts/bench/controller.py). The daemon makes few
# reference cycles; reference counting frees the rest at once.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_collector() -> None:
    gc.set_threshold(*GC_THRESHOLDS)


def freeze_long_lived() -> None:
    """After the first pass: what the daemon holds from then on (modules, the straggler window
    read cold) leaves the collector's generations, so full collections stop walking it."""
    gc.collect()
    gc.freeze()


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
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        settings = self.settings = config.settings
        self.database = database or Database.from_config(config)
        self.metrics = DaemonMetrics(self.database)
        conf = settings.slurm.conf
        # The commands in flight are ended when the daemon stops (stop); a client passed in
        # (tests) is its own.
        self._slurm_commands: SubprocessRunner | None = None
        if slurm is None:
            self._slurm_commands = SubprocessRunner({"SLURM_CONF": conf} if conf else None)
            slurm = CliSlurmClient(
                TimedRunner(self._slurm_commands, self.metrics),
                timeout_s=settings.slurm.command_timeout_s,
            )
        self.slurm = slurm
        self.policy = Policy.from_config(config)
        self.executor = Executor(
            self.database,
            self.slurm,
            observe_only=settings.daemon.observe_only,
            # A job that cannot be requeued is submitted again as the run's owner: as root
            # or as that very user; any other daemon records "waiting for the owner".
            submit_attempt=OwnerSubmitter(
                slurm_conf=conf or None, timeout_s=settings.slurm.command_timeout_s
            ),
            webhook=bool(settings.notify.webhook_url),
        )
        self.webhook = (
            WebhookOutbox(
                self.database, settings.notify.webhook_url, settings.notify.webhook_timeout_s
            )
            if settings.notify.webhook_url
            else None
        )
        self.clock = clock
        self._restart_ttl = timedelta(seconds=settings.policy.restart_command_ttl_s)
        # The straggler window's step times, read incrementally from one pass to the next.
        self.step_windows = StepWindows()
        # Since when each lost node has been lost: Slurm's word is confirmed before it is acted on.
        self.lost_sightings = LostSightings()
        self.passes = 0
        self.last_pass_at: datetime | None = None
        self.skipped_because: str | None = None  # why the last pass decided nothing
        self.notifier = notifier or Notifier()
        interval = settings.daemon.poll_interval_s
        self.liveness = LoopLiveness(settings.daemon.stuck_after_passes * interval)
        self._loop_stuck_logged = False
        self._stopped = threading.Event()
        self._in_pass = threading.Lock()  # held by the control pass; stop waits on it
        self._scheduler = BackgroundScheduler(
            timezone=UTC,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30},
        )
        self._scheduler.add_listener(self.metrics.on_scheduler_event, SCHEDULER_EVENTS)
        quiet_busy_skips()
        self._scheduler.add_listener(BusyJobs().on_event, BUSY_JOB_EVENTS)
        self.refusals = Refusals(self.database, self.metrics.server_refusals, clock=clock)
        self._ingest: IngestServer | None = None
        self._rpc: RpcServer | None = None
        self._ops: OpsServer | None = None
        self.listening_since: datetime | None = None  # set when the ingest endpoint opens

    # --- the periodic jobs ------------------------------------------------------------------

    def control_pass(self) -> int:
        """One observe → decide → act pass; returns the number of actions taken. A run whose
        part fails pass after pass is held (controller.pass_health)."""
        failures = PassFailures()
        try:
            with self.database.session() as session:
                view = observe(
                    session,
                    self.slurm,
                    now=self.clock(),
                    bucket=self.policy.straggler_bucket,
                    buckets=self.policy.straggler_window_buckets,
                    steps=self.step_windows,
                    lost=self.lost_sightings,
                    failures=failures,
                )
            view = replace(view, listening_since=self.listening_since)
            # Before this pass plans new ones: a worker restart nobody fetched in time is void.
            self.executor.expire_commands(self.clock(), self._restart_ttl)
        except DatabaseUnavailable as exc:
            log.warning("control pass skipped: %s", exc)
            self.skipped_because = "store"
            return 0
        if not view.slurm_reachable:
            if self._stopped.is_set():  # its Slurm commands were ended by the stop
                log.info("control pass cut short by the stop; nothing decided")
            else:
                log.warning("control pass skipped: Slurm unreachable; nothing decided")
            self.skipped_because = "slurm"
            return 0
        self.skipped_because = None
        decision = decide_runs(view, self.policy)
        actions = decision.actions
        since_last_pass = (
            (self.clock() - self.last_pass_at).total_seconds() if self.last_pass_at else None
        )
        # Each detection observed as its row commits.
        outcomes = self.executor.execute(
            actions, lambda o: self._observe_detection(o, since_last_pass)
        )
        self._settle_failures(view, decision, outcomes, failures)
        self.passes += 1
        if self.passes == 1:
            freeze_long_lived()
        self.last_pass_at = self.clock()
        return len(actions)

    def _settle_failures(
        self,
        view: v.ClusterView,
        decision: Decision,
        outcomes: list[Outcome],
        failures: PassFailures,
    ) -> None:
        """Count each tried run's part as failed or not this pass; hold the ones that failed
        pass after pass (controller.pass_health)."""
        for run_id, error in decision.failed.items():
            failures.add(run_id, "deciding", error)
        for outcome in outcomes:
            if outcome.internal and outcome.action.run_id is not None:
                failures.add(outcome.action.run_id, "acting", outcome.error or "")
        tried = {run.run_id for run in view.runs if not run.held}
        with self.database.session() as session:
            settle_pass(session, failures, tried)

    def _observe_detection(self, outcome: Outcome, since_last_pass: float | None) -> None:
        """Detection latency of a failure this pass found (see DaemonMetrics)."""
        action = outcome.action
        if not isinstance(action, v.RecordEvent) or outcome.status is not ActionStatus.DONE:
            return
        seconds = action.evidence.get("seconds", since_last_pass)
        if isinstance(seconds, int | float):
            self.metrics.detection_latency.labels(action.kind.value).observe(seconds)

    def _control_tick(self) -> None:
        """The main loop's step: a control pass, then the liveness the watchdog and /healthz
        read, then READY after the first pass that reached Slurm."""
        with self._in_pass:
            if not self._stopped.is_set():  # a pass queued before the stop does not start
                self._control_tick_unlocked()

    def _control_tick_unlocked(self) -> None:
        started = time.monotonic()
        try:
            self.control_pass()
        except Exception:
            # APScheduler logs the traceback. The loop's clock is not advanced: a pass that fails
            # every time ends in a stuck verdict (red /healthz, a restart by the watchdog).
            self.metrics.control_passes.labels("error").inc()
            raise
        self.metrics.control_pass_duration.observe(time.monotonic() - started)
        self.metrics.control_passes.labels(
            f"skipped_{self.skipped_because}" if self.skipped_because else "completed"
        ).inc()
        self.metrics.last_control_pass.set_to_current_time()
        slurm_reachable = None if self.skipped_because == "store" else not self.skipped_because
        self.liveness.tick(slurm_reachable=slurm_reachable)
        if self._loop_stuck_logged:
            log.warning("main loop running again")
            self._loop_stuck_logged = False
        if self.passes and not self.notifier.ready_sent:
            self.notifier.ready(f"watching Slurm every {self.settings.daemon.poll_interval_s:g}s")
            log.info("ready: schema at head, first Slurm poll succeeded")
        elif self.skipped_because and not self.notifier.ready_sent:
            self.notifier.status(f"waiting for {self.skipped_because} before READY")

    def _watchdog_tick(self) -> None:
        """Ping systemd only while the main loop lives: a stuck loop gets the daemon restarted.
        systemd arms the watchdog once start-up is over, so pinging starts after READY."""
        if not self.notifier.ready_sent:
            return
        if self.liveness.alive():
            self.notifier.watchdog()
            return
        if not self._loop_stuck_logged:
            self._loop_stuck_logged = True
            log.error(
                "main loop stuck: no control pass for %.0fs (limit %.0fs); withholding watchdog "
                "pings so systemd restarts the daemon",
                self.liveness.seconds_since_pass(),
                self.liveness.stuck_after_s,
            )

    def retention_pass(self) -> None:
        now = self.clock()
        raw_window = timedelta(hours=self.settings.retention.step_times_raw_hours)
        samples_window = timedelta(hours=self.settings.retention.heartbeat_history_hours)
        folded = pruned = 0
        try:
            # A minute of one run per transaction: the store's writer lock (SQLite's one) is
            # held for one minute's fold at a time, and agents' reports commit in between.
            with self.database.session() as session:
                todo = minutes_to_fold(
                    session, now - raw_window, max_minutes=RETENTION_MINUTES_PER_PASS
                )
            for run_id, minute in todo:
                with self.database.session() as session:
                    folded += fold_minute(session, run_id, minute)
            with self.database.session() as session:
                pruned = prune_heartbeat_samples(session, now - samples_window)
        except DatabaseUnavailable as exc:
            log.warning("retention pass stopped: %s", exc)
        if folded:  # raw rows left the store: the held windows must not count them
            self.step_windows.invalidate()
        if folded or pruned:
            log.info("retention: folded %d step times, pruned %d heartbeat samples", folded, pruned)

    def goodput_pass(self) -> None:
        """Measure the failures training is back past (slurmft.controller.goodput_pass); before
        retention folds their raw step times, which runs far less often."""
        try:
            with self.database.session() as session:
                measured = measure_failures(session, self.clock())
        except DatabaseUnavailable as exc:
            log.warning("goodput pass skipped: %s", exc)
            return
        for outage in measured:
            back_s = outage.lost.detection_s + outage.lost.restart_s + outage.lost.queue_wait_s
            self.metrics.observe_recovery(outage.kind, back_s)
            log.info(
                "goodput: %s outage measured (%d reports): %.1f s lost",
                outage.kind.value,
                outage.reports,
                outage.lost.total_s,
            )

    def webhook_pass(self) -> None:
        """Send the notices waiting in the store's outbox (see webhook.py)."""
        assert self.webhook is not None
        try:
            delivered = self.webhook.deliver()
        except DatabaseUnavailable as exc:
            log.warning("webhook pass skipped: %s", exc)
            return
        if delivered:
            log.info("webhook: %d notices delivered", delivered)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> Daemon:
        """Check the schema, open the endpoints, schedule the jobs. Refuses an old schema."""
        self.database.require_current()
        tune_collector()
        daemon = self.settings.daemon
        host, port = _host_port(daemon.ingest_listen, "daemon.ingest_listen")
        # Agents are heard from now on: silences before this are the daemon's own absence.
        self.listening_since = self.clock()
        self._ingest = IngestServer(
            self.database,
            host,
            port,
            sample_every=timedelta(seconds=self.settings.retention.heartbeat_sample_s),
            clock=self.clock,
            observe=self.metrics.observe_ingest,
            restart_ttl=self._restart_ttl,
            limits=self._limits(daemon.ingest_max_connections, daemon.ingest_workers),
            tls=server_tls(daemon.ingest_tls_cert, daemon.ingest_tls_key),
            on_refusal=self.refusals.ingest_hook,
            on_connection_refused=self.refusals.connection_hook("ingest"),
            rate_limits=RateLimits.from_settings(daemon),
        ).start()
        try:
            agents_url = self._agents_url()
        except ConfigError:
            self._ingest.stop()
            raise
        self._rpc = RpcServer(
            self.config.runtime_dir / SOCKET_NAME,
            operations(
                self.database,
                slurm=self.slurm,
                controller_url=agents_url,
                admins=Admins(self.config.settings.daemon.admin_group),
                ca_file=daemon.agents_ca_file,
                quota=RunQuota.from_settings(daemon),
                on_refusal=self.metrics.count_refusal,
                lemon_min_runs=self.settings.trust.lemon_min_runs,
                restart_cap=self.settings.policy.max_restarts_without_progress,
            ),
            limits=self._limits(
                daemon.socket_max_connections,
                daemon.socket_workers,
                MAX_REQUEST_BYTES,
                max_per_caller=daemon.socket_max_per_user,
            ),
            on_refusal=self.refusals.connection_hook("socket"),
        ).start()
        host, port = _host_port(daemon.metrics_listen, "daemon.metrics_listen")
        self._ops = OpsServer(
            self.metrics.registry,
            lambda: check_health(self.liveness, self.database),
            host,
            port,
            limits=self._limits(OPS_LIMITS.max_connections, OPS_LIMITS.workers),
            on_refusal=self.refusals.connection_hook("metrics"),
        ).start()
        self._scheduler.add_job(
            self.refusals.flush, "interval", seconds=REFUSAL_AUDIT_INTERVAL_S, id="refusal_audit"
        )
        interval = self.settings.daemon.poll_interval_s
        self.liveness.tick()  # the loop's clock starts now, not at construction
        self._scheduler.add_job(
            self._control_tick,
            "interval",
            seconds=interval,
            id="control",
            next_run_time=self.clock(),
        )
        self._scheduler.add_job(
            self.retention_pass, "interval", seconds=RETENTION_INTERVAL_S, id="retention"
        )
        self._scheduler.add_job(
            self.goodput_pass, "interval", seconds=GOODPUT_INTERVAL_S, id="goodput"
        )
        if self.webhook is not None:
            self._scheduler.add_job(
                self.webhook_pass,
                "interval",
                seconds=self.settings.notify.webhook_interval_s,
                id="webhook",
                next_run_time=self.clock(),
            )
        watchdog_s = self.notifier.watchdog_interval_s
        if watchdog_s is not None:
            self._scheduler.add_job(
                self._watchdog_tick,
                "interval",
                seconds=watchdog_s,
                id="watchdog",
                next_run_time=self.clock(),
            )
        self._scheduler.start()
        log.info(
            "slurmft daemon up: store %s, ingest %s, socket %s, metrics %s, every %.1fs%s%s",
            self.database.describe(),
            self._ingest.url,
            self._rpc.path,
            self._ops.url,
            interval,
            f", watchdog ping every {watchdog_s:.1f}s" if watchdog_s else "",
            " (observe-only)" if self.settings.daemon.observe_only else "",
        )
        return self

    def _limits(
        self,
        max_connections: int,
        workers: int,
        max_head_bytes: int = 64 * 1024,
        *,
        max_per_caller: int = 0,
    ) -> ServerLimits:
        daemon = self.settings.daemon
        return ServerLimits(
            max_connections=max_connections,
            workers=workers,
            header_timeout_s=daemon.header_timeout_s,
            body_timeout_s=daemon.body_timeout_s,
            idle_timeout_s=daemon.idle_timeout_s,
            max_head_bytes=max_head_bytes,
            max_per_caller=max_per_caller,
        )

    def _agents_url(self) -> str:
        """The URL agents on compute nodes report to (slurmft.controller.agents_url); a URL
        they could not reach is a ConfigError naming the setting to set."""
        chosen = choose_agents_url(
            self.settings.daemon.agents_url, self.settings.agent.controller_url, self.ingest_url
        )
        try:
            addresses: dict[str, str] | None = self.slurm.node_addresses()
        except SlurmError as error:
            addresses = None
            log.warning("Slurm did not list the nodes (%s): %s is not checked", error, chosen.url)
        refusal = unreachable_because(
            chosen, addresses, is_local=is_local_address, is_loopback=is_loopback_host
        )
        if refusal is not None:
            raise ConfigError(refusal)
        log.info("agents report to %s (from %s)", chosen.url, chosen.source)
        return chosen.url

    @property
    def ingest_url(self) -> str:
        assert self._ingest is not None, "start() first"
        return self._ingest.url

    @property
    def metrics_url(self) -> str:
        assert self._ops is not None, "start() first"
        return self._ops.url

    def stop(self) -> bool:
        """Stop passes and servers; False when the control pass in flight did not end (the
        process must then exit without it: the interpreter would wait for its thread)."""
        self.notifier.stopping()
        self._stopped.set()
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)  # the control pass is waited for below
        # A command waiting on a busy slurmctld would hold the stop for its timeout, one after
        # another (systemd's SIGKILL comes first): they end now, and the pass with them. An
        # effect cut short is settled at the next start (slurmft.controller.intents).
        if self._slurm_commands is not None:
            self._slurm_commands.stop("the daemon is stopping")
        grace_s = STOP_GRACE_S if self.liveness.alive() else 0.0  # a stuck loop: no waiting
        pass_ended = self._in_pass.acquire(timeout=grace_s)
        if pass_ended:
            self._in_pass.release()
        else:
            log.error(
                "the control pass in flight did not end within %gs of the stop (no pass ended "
                "for %.0fs): stopping without it; what it was doing is settled at the next start",
                grace_s,
                self.liveness.seconds_since_pass(),
            )
        for server in (self._ingest, self._rpc, self._ops):
            if server is not None:
                server.stop()
        self.refusals.flush()
        self.database.dispose()
        return pass_ended

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
            if not self.stop():
                logging.shutdown()
                os._exit(1)  # the stuck pass's thread would hold the interpreter's exit
