"""The node agent: preflight, torchrun, rank reports to the controller, hangs, leaving.

One agent runs per node of the allocation. It checks the node (GPU probe, clock skew), runs
torchrun through the launcher (which applies the wait-list fix), receives what the local ranks
report over the node-local channel and forwards it in batches, saves the stacks of hung workers
before it kills them, and stops its workers and exits when the controller says `leave` or when
it gets SIGTERM, so that a spare takes this node's place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slurmft.agent.channel import RankChannelServer, RendezvousRound, StoreHealth
from slurmft.agent.clock import measure_skew
from slurmft.agent.command import TorchrunSpec, launcher_argv, torchrun_env
from slurmft.agent.evidence import EVENT_TEXT_LIMIT, dump_stacks, ensure_dir, is_stopped
from slurmft.agent.exits import AgentExit
from slurmft.agent.probe import NoGpuProbe, Probe
from slurmft.agent.procs import is_alive, kill_tree
from slurmft.agent.reporter import HttpTransport, Reporter, RetryableError
from slurmft.agent.sightings import SightingLog
from slurmft.agent.snapshot_dirs import HeldSnapshotDir, SnapshotDirBusy, sweep_orphans
from slurmft.config import AgentSection, GpuSection
from slurmft.core.budget import Seen, named_round, round_key
from slurmft.core.exits import StepOutcome
from slurmft.core.kinds import EventKind, FaultClass
from slurmft.protocol import AgentEvent, Command, CommandKind, RankHeartbeat

log = logging.getLogger("slurmft.agent")
LEAVE_PREFIX = "leave: "  # the stop reason of an agent the controller told to leave

POLL_S = 0.1
# torchrun exits a second or so after the store it depends on fails; a failure older than this
# (its `store_back` lost, say) is not what ended it.
STORE_FAILURE_DATES_EXIT_S = 30.0
# The controller repeats a pending command in every reply until it sees its effect; one restart
# per this window answers it.
RESTART_COMMAND_COOLDOWN_S = 60.0


@dataclass(frozen=True)
class AgentSettings:
    spec: TorchrunSpec
    node: str
    run_id: str
    work_dir: Path  # node-local; short, because it holds the unix socket
    # The [agent] and [gpu] sections' defaults (slurmft.config); `slurmft agent run` passes the
    # effective values.
    controller_url: str = AgentSection.controller_url
    ca_file: str = AgentSection.ca_file
    token: str = ""
    report_interval_s: float = AgentSection.report_interval_s
    max_buffered: int = AgentSection.report_buffer_max
    max_clock_skew_s: float = AgentSection.max_clock_skew_s
    stop_grace_s: float = AgentSection.stop_grace_s
    stack_wait_s: float = AgentSection.stack_dump_wait_s
    gpu_poll_s: float = GpuSection.poll_interval_s
    python: str = sys.executable
    step_dir: str = ""  # the batch step's folder for this agent step (outcome, sightings)

    @property
    def agent_step(self) -> str:
        """The batch step's launch ("<job>.<launch>") this agent runs in: rendezvous round
        numbers count within it (budget.round_key)."""
        return Path(self.step_dir).name if self.step_dir else ""

    @property
    def socket_path(self) -> Path:
        return self.work_dir / "ranks.sock"

    @property
    def stacks_dir(self) -> Path:
        return self.work_dir / "stacks"

    @property
    def save_request_file(self) -> Path:
        return self.work_dir / "save-request"

    @property
    def worker_log_dir(self) -> Path:
        return self.work_dir / "worker-logs"

    @property
    def snapshot_dir(self) -> Path:
        """Where the node's in-memory snapshots go (slurmft.train.snapshot): tmpfs, where there
        is one; removed when the agent ends (they are worth nothing after the run on this node)."""
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            return shm / f"slurmft-{os.getuid()}-{self.work_dir.name}"
        return self.work_dir / "snapshots"


@dataclass
class WorkerSeen:
    """The latest heartbeat of one local worker."""

    rank: int
    pid: int
    restart_count: int
    overdue: bool
    phase: str
    progress_age_s: float


@dataclass
class AgentState:
    workers: dict[int, WorkerSeen] = field(default_factory=dict)  # by local rank
    restart_counts_seen: set[int] = field(default_factory=set)
    rounds_told: bool = False  # the launcher reports torchrun's rendezvous rounds
    killed_pids: set[int] = field(default_factory=set)
    stop_reason: str = ""
    restart_requested: str = ""  # a restart_workers command not yet carried out
    last_commanded_restart: float = float("-inf")
    gpu_checked_at: float = float("-inf")
    store_failed: StoreHealth | None = None  # the launcher finds the store failing, since when
    # The reporter's thread sets a request while the main loop takes it: without the lock a
    # request set between the loop's read and its clearing was lost (and the controller had
    # already marked it delivered).
    restart_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request_restart(self, reason: str, now: float, cooldown_s: float) -> None:
        with self.restart_lock:
            if now - self.last_commanded_restart >= cooldown_s:
                self.last_commanded_restart = now
                self.restart_requested = reason

    def take_restart_request(self) -> str:
        with self.restart_lock:
            requested, self.restart_requested = self.restart_requested, ""
        return requested


class NodeAgent:
    def __init__(self, settings: AgentSettings, probe: Probe | None = None):
        self.settings = settings
        self.probe = probe or NoGpuProbe()
        self.state = AgentState()
        self.transport: HttpTransport | None = None
        self.reporter: Reporter | None = None
        if settings.controller_url:
            self.transport = HttpTransport(
                settings.controller_url, settings.token, ca_file=settings.ca_file
            )
            self.reporter = Reporter(
                self.transport,
                run_id=settings.run_id,
                node=settings.node,
                on_command=self.on_command,
                interval_s=settings.report_interval_s,
                max_buffered=settings.max_buffered,
            )
        # What the batch step counts the restart budget from while the daemon is away.
        self.sightings = SightingLog(settings.step_dir, settings.node)
        self._stop = threading.Event()
        self.snapshots: HeldSnapshotDir | None = None  # the node's snapshot folder, once held

    # -- reports ---------------------------------------------------------------------------------
    def event(
        self,
        kind: EventKind,
        message: str,
        *,
        rank: int | None = None,
        fault_class: FaultClass | None = None,
        occurred_at: float | None = None,
        **details: Any,
    ) -> None:
        log.info("%s: %s", kind.value, message)
        if self.reporter is not None:
            self.reporter.add_event(
                AgentEvent(
                    kind=kind,
                    occurred_at=time.time() if occurred_at is None else occurred_at,
                    message=message,
                    rank=rank,
                    fault_class=fault_class,
                    details={"node": self.settings.node, **details},
                )
            )

    def on_command(self, command: Command) -> None:
        if command.kind == CommandKind.LEAVE:
            self.request_stop(f"{LEAVE_PREFIX}{command.reason or 'asked by the controller'}")
        elif command.kind == CommandKind.RESTART_WORKERS:
            self.state.request_restart(
                command.reason or "asked by the controller",
                time.monotonic(),
                RESTART_COMMAND_COOLDOWN_S,
            )
        else:
            log.warning("unknown command %r ignored", command.kind)

    def request_save(self) -> None:
        """Ask the local ranks for a coordinated save (time limit, preemption): they see the
        file's new modification time at their next step and agree on the step to save at."""
        self.settings.save_request_file.touch()
        os.utime(self.settings.save_request_file)

    def request_stop(self, reason: str) -> None:
        if not self.state.stop_reason:
            self.state.stop_reason = reason
        self._stop.set()

    # -- preflight ---------------------------------------------------------------------------------
    def preflight(self) -> bool:
        report = self.probe.probe()
        if not report.has_gpus:
            log.info("%s", report.note or "no GPU on this node")
        for fault in report.faults:  # the preflight passes on drain-class conditions only
            self.event(
                EventKind.GPU_FAULT,
                fault.message,
                fault_class=FaultClass.HARDWARE,
                gpu_index=fault.gpu_index,
                xid=fault.xid,
                action="drain",
                fault_kind=fault.kind,
                code=fault.code,
                detail=fault.detail,
            )
        if not report.fit:
            self.event(
                EventKind.PREFLIGHT_FAILED,
                "GPU preflight failed: node unfit to train",
                fault_class=FaultClass.HARDWARE,
            )
            return False
        self.check_clock()
        return True

    def check_clock(self) -> None:
        if self.transport is None:
            return
        try:
            skew = measure_skew(self.transport.server_time)
        except RetryableError as error:
            log.warning("controller unreachable (%s): clock skew not checked", error)
            return
        if skew.too_large(self.settings.max_clock_skew_s):
            # Not fatal: the run may still work, but keep-alive expiry becomes unreliable.
            self.event(
                EventKind.PREFLIGHT_FAILED,
                f"clock {skew.offset_s:+.2f} s off the controller's (limit "
                f"{self.settings.max_clock_skew_s} s): rendezvous keep-alive may misjudge nodes",
                fault_class=FaultClass.INFRASTRUCTURE,
                check="clock_skew",
                offset_s=skew.offset_s,
                round_trip_s=skew.round_trip_s,
                fatal=False,
            )

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> AgentExit:
        ensure_dir(self.settings.work_dir)
        ensure_dir(self.settings.stacks_dir)
        self.snapshots = self._hold_snapshot_dir()
        if self.reporter is not None:
            self.reporter.start()
        try:
            if not self.preflight():
                return AgentExit.PREFLIGHT_FAILED
            channel = RankChannelServer(str(self.settings.socket_path))
            try:
                return self._run_torchrun(channel)
            finally:
                channel.close()
        finally:
            if self.snapshots is not None:
                self.snapshots.release()
            if self.reporter is not None:
                self.reporter.stop(flush_timeout_s=5.0)

    def _hold_snapshot_dir(self) -> HeldSnapshotDir | None:
        """The node's snapshot folder, held for the agent's life; first the folders of this
        user's agents that died without removing theirs go (they hold RAM until a reboot)."""
        path = self.settings.snapshot_dir
        for orphan in sweep_orphans(path.parent, os.getuid(), keep=path):
            log.info("removed %s: its agent is gone", orphan)
        held = HeldSnapshotDir(path)
        try:
            held.acquire()
        except (SnapshotDirBusy, OSError) as error:
            log.warning("no in-memory snapshots on this node: %s", error)
            return None
        return held

    def _run_torchrun(self, channel: RankChannelServer) -> AgentExit:
        settings = self.settings
        env = torchrun_env(
            dict(os.environ),
            agent_socket=str(settings.socket_path),
            stacks_dir=str(settings.stacks_dir),
            save_request_file=str(settings.save_request_file),
            snapshot_dir=str(self.snapshots.path) if self.snapshots is not None else "",
        )
        spec = dataclasses.replace(settings.spec, worker_log_dir=str(settings.worker_log_dir))
        argv = launcher_argv(spec, settings.python)
        log.info("starting torchrun: %s", " ".join(argv))
        process = subprocess.Popen(argv, env=env)
        while True:
            returncode = process.poll()
            self._take_reports(channel)
            if returncode is not None:
                return self._exit_code(returncode)
            self._report_gpu_faults()
            self._kill_hung_workers()
            if self._stop.wait(POLL_S):
                self._stop_torchrun(process)
                self._take_reports(channel)
                self.event(
                    EventKind.AGENT_STOPPED,
                    f"agent stopped ({self.state.stop_reason})",
                    reason=self.state.stop_reason,
                    cordoned=self.state.stop_reason.startswith(LEAVE_PREFIX),
                )
                return AgentExit.LEFT

    def outcome(self, code: AgentExit) -> StepOutcome:
        """How this agent ended, for the batch step (batch.StepOutcomes): a node the controller
        cordoned is told apart from one stopped by a signal (the batch step's own stop)."""
        if code is AgentExit.LEFT and self.state.stop_reason.startswith(LEAVE_PREFIX):
            return StepOutcome.LEFT_CORDONED
        return StepOutcome(code.name)

    def _exit_code(self, returncode: int) -> AgentExit:
        if returncode == 0:
            return AgentExit.FINISHED
        if returncode == AgentExit.SPARE_REFUSED and self.settings.spec.spare_candidate:
            self.event(
                EventKind.SPARE_REFUSED,
                "spare refused: the wait-list fix does not know this torch",
            )
            return AgentExit.SPARE_REFUSED
        if returncode == AgentExit.FENCED:
            self.event(
                EventKind.FENCED,
                "declared dead by its peers, then ran again: its workers were stopped before "
                "they could train or write, and this agent leaves",
            )
            return AgentExit.FENCED
        log.error("torchrun exited with %d", returncode)
        if not self._stop.is_set():  # not the signal that stops this agent too (a requeue)
            self._report_launcher_failed(returncode)
        return AgentExit.FAILED

    def _report_launcher_failed(self, returncode: int) -> None:
        """Told, not only logged: a requeued job's log is rewritten, and the daemon takes this
        as the first sign of an outage no rank lived to report. Dated from the store's failure
        when the launcher saw one (it exits a second or so after it)."""
        failed = self.state.store_failed
        now = time.time()
        if failed is None or now - failed.at > STORE_FAILURE_DATES_EXIT_S:
            self.event(EventKind.LAUNCHER_FAILED, f"torchrun exited with {returncode}",
                       exit_code=returncode)  # fmt: skip
            return
        self.event(
            EventKind.LAUNCHER_FAILED,
            f"torchrun exited with {returncode} after the rendezvous store failed "
            f"({failed.error})",
            occurred_at=failed.at,
            exit_code=returncode,
            store_error=failed.error,
            exited_at=now,
        )

    def _stop_torchrun(self, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM: torchrun stops its workers without closing the rendezvous (a closed
        rendezvous would end every other agent too); past the grace period, kill the tree."""
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=self.settings.stop_grace_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "torchrun did not stop in %.0f s: killing it and its workers",
                self.settings.stop_grace_s,
            )
            kill_tree(process.pid)
            process.wait(timeout=10)
        for worker in self.state.workers.values():  # workers orphaned by a killed torchrun
            if is_alive(worker.pid):
                kill_tree(worker.pid)

    def _report_gpu_faults(self) -> None:
        """GPU faults found during the run go to the daemon, which drains and excludes the
        node for drain-class ones (its `leave` command then brings a spare in)."""
        now = time.monotonic()
        if now - self.state.gpu_checked_at < self.settings.gpu_poll_s:
            return
        self.state.gpu_checked_at = now
        try:
            faults = self.probe.new_faults()
        except Exception:  # a broken probe must never take training down with it
            log.exception("GPU probe failed; training goes on")
            return
        for fault in faults:
            self.event(
                EventKind.GPU_FAULT,
                fault.message,
                fault_class=FaultClass(fault.fault_class),
                gpu_index=fault.gpu_index,
                xid=fault.xid,
                action=fault.action,
                fault_kind=fault.kind,
                code=fault.code,
                detail=fault.detail,
            )

    # -- rank reports and hangs -------------------------------------------------------------------
    def _take_reports(self, channel: RankChannelServer) -> None:
        for received in channel.drain():
            record = received
            if isinstance(record, RendezvousRound):
                self._saw_round(record)
                continue
            if isinstance(record, StoreHealth):
                self.state.store_failed = record if record.failed else None
                continue
            if isinstance(record, RankHeartbeat):
                if record.pid in self.state.killed_pids:
                    # A killed worker's last beats may still be in the channel (a stopped one
                    # beats during its stack dump): forwarded, it would look alive while its
                    # peers went quiet.
                    continue
                self._saw_heartbeat(record)
            elif isinstance(record, AgentEvent):
                record = self._named_round(record)
                self._saw_rank_event(record)
            if self.reporter is not None:
                self.reporter.add(record)

    def _saw_round(self, joined: RendezvousRound) -> None:
        """Every round after torchrun's first is a restart of this node's workers, named by the
        round it ended: all agents name the same one, so the daemon counts it once."""
        self.state.rounds_told = True
        if joined.previous is None:
            log.info("torchrun joined rendezvous round %d", joined.round)
            return
        ended = round_key(self.settings.agent_step, joined.previous)
        self.sightings.record(Seen.RESTART, round=ended, at=joined.at)
        self.event(
            EventKind.RESTART,
            f"workers restarted (rendezvous round {joined.previous} -> {joined.round})",
            rdzv_round=ended,
            joined_round=joined.round,
        )

    def _saw_heartbeat(self, hb: RankHeartbeat) -> None:
        self.state.workers[hb.local_rank] = WorkerSeen(
            hb.rank, hb.pid, hb.restart_count, hb.overdue, hb.phase, hb.progress_age_s
        )
        if hb.restart_count not in self.state.restart_counts_seen:
            self.state.restart_counts_seen.add(hb.restart_count)  # once per node, not per rank
            # Without rounds (a launcher that could not read them), torch's own count: it
            # misses restarts for a change of members, but never reports one twice.
            if hb.restart_count and not self.state.rounds_told:
                self.sightings.record(Seen.RESTART)
                self.event(
                    EventKind.RESTART,
                    f"workers restarted (restart {hb.restart_count})",
                    rank=hb.rank,
                    restart_count=hb.restart_count,
                )

    def _named_round(self, event: AgentEvent) -> AgentEvent:
        """A rank's report names the round its workers ran in: named in this agent step."""
        worker_round = event.details.get("rdzv_round")
        if not isinstance(worker_round, int):
            return event
        named = round_key(self.settings.agent_step, worker_round)
        return msgspec.structs.replace(event, details={**event.details, "rdzv_round": named})

    def _saw_rank_event(self, event: AgentEvent) -> None:
        if event.kind == EventKind.COLLECTIVE_ERROR:
            rank = event.rank if event.rank is not None else -1
            self.sightings.record(
                Seen.FAILURE, rank=rank, at=event.occurred_at, round=named_round(event.details)
            )
        elif event.kind == EventKind.CHECKPOINT and isinstance(event.details.get("step"), int):
            self.sightings.record(Seen.CHECKPOINT, step=event.details["step"], at=event.occurred_at)
        elif event.kind == EventKind.NUMERICAL_FAULT and event.fault_class == FaultClass.NUMERICAL:
            # Reproduced on re-run: under `stop` the workers exit and torchrun restarts them.
            self.sightings.record(Seen.NUMERICAL, at=event.occurred_at)

    def _kill_hung_workers(self) -> None:
        alive = [
            w
            for w in self.state.workers.values()
            if w.pid not in self.state.killed_pids and is_alive(w.pid)
        ]
        hung = [w for w in alive if w.overdue]
        # A commanded restart is taken here whatever happens: killing hung workers carries it
        # out, and with no worker alive it is under way already (torchrun restarts workers
        # whose peers failed); kept, it would kill the fresh workers.
        requested = self.state.take_restart_request()
        if hung:
            first = hung[0]
            why = f"rank {first.rank} stuck in {first.phase} for {first.progress_age_s:.0f} s"
        elif requested and alive:
            hung, why = alive, f"controller: {requested}"
        else:
            return
        # A stopped worker exits after its dump: it is one of the killed, overdue or not yet.
        hung += [w for w in alive if w not in hung and is_stopped(w.pid)]
        dumps = dump_stacks(
            {w.rank: w.pid for w in alive},
            self.settings.stacks_dir,
            wait_s=self.settings.stack_wait_s,
        )
        self.event(
            EventKind.HANG,
            f"{why}: stacks saved, killing {len(hung)} worker(s)",
            rank=hung[0].rank,
            fault_class=FaultClass.HANG,
            hung_ranks=[w.rank for w in hung],
            stack_files={str(d.rank): str(d.path) for d in dumps},
            stacks={str(d.rank): d.text[:EVENT_TEXT_LIMIT] for d in dumps},
        )
        self.sightings.record(Seen.HANG)
        for worker in hung:
            self.state.killed_pids.add(worker.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)  # torchrun makes each worker a session
            kill_tree(worker.pid)
