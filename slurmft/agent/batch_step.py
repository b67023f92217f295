"""The batch step (node 0 of the allocation): hosts the rendezvous store, runs the agent step,
relaunches it on the usable nodes, requeues the job, and keeps the restart budget.

It works without the controller: the budget ("restarts in a row without a newer checkpoint")
lives in the checkpoint directory, so it survives requeues. It counts the agent steps that end,
and, while a step runs, torchrun's in-place restarts from what the agents record in the step's
folder (slurmft.agent.sightings), with the daemon's rule; a spent budget stops the step.

On USR1 (`--signal=B:USR1@T`, which reaches only this batch shell) it forwards USR1 to the agent
step (srun passes it to every agent, each agent asks its ranks to save), waits for the newer
checkpoint, and requeues its own job (an owner may requeue their job; no privilege needed).
A time-limit requeue does not use the budget.

At start, and after each relaunch on other nodes, it reports its allocation to the daemon under
the run's token: its SLURM_JOB_ID and the nodes of the agent step with their roles (the first N
train, the rest are spares), through a reporter of its own (`report_allocation`). The daemon
checks the report against Slurm before it stores anything (slurmft.controller.allocation), and
acts on the run's evidence only for those nodes.

A checkpoint filesystem that is full or read-only does not stop it: the batch step is what
keeps the job's agents supervised, so a state it cannot save is kept in memory, logged (with
the error, once until it is saved again), and saved again at every poll and every change;
an outcome folder it cannot make leaves the step without outcomes (nothing cordoned, nothing
finished by them), not without supervision. The batch step has no channel to the daemon of its
own (its agents report): the job's log says it.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from slurmft.agent.batch import (
    BatchSpec,
    BatchState,
    Move,
    StepOutcomes,
    after_step,
    file_checkpoint_event,
    newest_checkpoint,
    srun_argv,
    usable_nodes,
)
from slurmft.agent.sightings import charge_step, read_step
from slurmft.agent.store import StoreSupervisor, check_store_host
from slurmft.config import PolicySection
from slurmft.core.budget import RestartBudget, Seen, Sighting
from slurmft.core.checkpoints import CheckpointWatch
from slurmft.core.exits import BatchExit
from slurmft.core.kinds import NodeRole
from slurmft.protocol import AgentEvent, AllocationMember, AllocationReport
from slurmft.slurm.api import NodeInfo, SignalTarget, SlurmClient, SlurmError, silent_nodes
from slurmft.slurm.lost_sightings import LostSightings

log = logging.getLogger("slurmft.batch")

OUTCOME_ROOT = ".slurmft/steps"  # under the checkpoint directory: one folder per agent step
# A daemon that watches the run counts the same failures and stops it itself, within about two
# of its polls (5 s each) of the failure over the cap; the batch step leaves it that long, so a
# run the daemon watches ends with the daemon's reason, and one it does not, about as fast.
GIVE_UP_GRACE_S = 20.0
# How long a GRES job's requeue waits for its silent nodes to be DOWN: Slurm's default
# SlurmdTimeout (300 s) and a minute, for a site without a daemon to set them DOWN sooner.
FENCE_WAIT_S = 360.0
CONFIRM_S = PolicySection.confirm_s  # the daemon's default; the job's config sets it
FINISH_GRACE_S = 30.0  # after one agent's training finished, for the others to end


def allocation_report(job_id: str, nodes: Sequence[str], active: int) -> AllocationReport:
    """The agent step's nodes as the daemon is told them: the first ``active`` train (an
    agent's index is its place in the step, SLURM_NODEID), the others wait as spares."""
    return AllocationReport(
        job_id=job_id,
        nodes=tuple(
            AllocationMember(node, NodeRole.ACTIVE if index < active else NodeRole.SPARE)
            for index, node in enumerate(nodes)
        ),
    )


def _why(error: OSError) -> str:
    """`[Errno 28] No space left on device: 'path'` as `No space left on device (ENOSPC)`."""
    code = errno.errorcode.get(error.errno or 0, "")
    return f"{error.strerror or error}" + (f" ({code})" if code else "")


def store_address(store_host: str = "") -> str:
    """Where the batch step hosts the rendezvous store: ``store_host``, else this node's host
    name's address (the job network's, where the agents reach it); never every interface's
    (ValueError). The store is unauthenticated: docs/install.md, "Security model"."""
    return check_store_host(store_host or socket.gethostbyname(socket.gethostname()))


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class BatchStep:
    def __init__(
        self,
        spec: BatchSpec,
        client: SlurmClient,
        job_id: str,
        store_host: str,
        *,
        poll_s: float = 5.0,
        stop_grace_s: float = 20.0,
        give_up_grace_s: float = GIVE_UP_GRACE_S,
        fence_wait_s: float = FENCE_WAIT_S,
        confirm_s: float = CONFIRM_S,
        finish_grace_s: float = FINISH_GRACE_S,
        report_allocation: Callable[[AllocationReport], None] | None = None,
        report_event: Callable[[AgentEvent], None] | None = None,
    ):
        self.spec, self.client, self.job_id = spec, client, job_id
        self.store_host = store_host
        self.poll_s, self.stop_grace_s = poll_s, stop_grace_s
        self.give_up_grace_s, self.fence_wait_s = give_up_grace_s, fence_wait_s
        # Slurm's word that a node stopped answering, dated from its first sighting: the step
        # is ended for it once it has held `confirm_s` (a flicker costs nothing), or at once
        # when Slurm has the node DOWN or has taken it out of the job.
        self.confirm_s, self.lost = confirm_s, LostSightings()
        self.finish_grace_s = finish_grace_s
        self.finished_seen_at: float | None = None  # the current step's first finished agent
        self.state = BatchState.load(spec.ckpt_dir, spec.max_restarts_without_progress)
        self.save_requested = threading.Event()
        self.outcome_dir = ""  # the current agent step's (see batch.StepOutcomes)
        self.cordoned: set[str] = set()  # nodes whose agents left this job for good
        # The current agent step's budget: charged before it, and what the batch step saw
        # itself (nodes Slurm took away, checkpoints published), next to the agents' records.
        self.step_before = self.state.budget
        self.step_seen: list[Sighting] = []
        self.step_gone: set[str] = set()
        self.step_stopped_at: datetime | None = None  # agents leave on the batch step's stop
        self.step_spent: RestartBudget | None = None  # the first spent budget of the step
        self.step_spent_at = 0.0
        self.checkpoints = CheckpointWatch(spec.ckpt_dir)
        self.checkpoint_seen = ""  # the label of the newest checkpoint noted
        self.report_allocation = report_allocation  # to the daemon (its reporter); None: none
        self.report_event = report_event
        self.reported_nodes: tuple[str, ...] | None = None
        self.unsaved: str | None = None  # why the last state could not be saved, until it is

    def _new_outcome_dir(self) -> str:
        path = Path(self.spec.ckpt_dir) / OUTCOME_ROOT / f"{self.job_id}.{self.state.step_launches}"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            # The agents cannot write there either (they log it and go on): the step runs
            # without outcomes, and its end is judged by srun's exit status alone.
            log.error("cannot make the agent step's outcome folder %s (%s)", path, _why(error))
        return str(path)

    def _read_outcomes(self) -> StepOutcomes:
        outcomes = StepOutcomes.read(self.outcome_dir)
        newly = outcomes.cordoned - self.cordoned
        if newly:
            log.info("cordoned for this job (their agents left): %s", ",".join(sorted(newly)))
            self.cordoned |= newly
        return outcomes

    def request_save_and_requeue(self) -> None:
        """The USR1 handler: only sets a flag; the loop does the work."""
        self.save_requested.set()

    def usable(self) -> list[str]:
        job = self.client.job(self.job_id)
        # A --no-kill job shrinks when a node dies; SLURM_JOB_NODELIST is not updated.
        return usable_nodes(job.nodes, self.client.nodes(job.nodes), sorted(self.cordoned))

    def run(self) -> BatchExit:
        # The job's output holds every attempt of a requeued job: `slurmft logs --attempt`
        # finds each one's part by this line (slurmft.cli.logs_cmd.ATTEMPT_MARK).
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        log.info("batch step of job %s, Slurm restart %s, on %s", self.job_id, restarts, host)
        if self.spec.store_port == 0:
            # Two jobs' batch steps may share a node: take a free port, the agents get it in
            # their rendezvous endpoint.
            self.spec = replace(self.spec, store_port=free_port(self.store_host))
        supervisor = StoreSupervisor(self.store_host, self.spec.store_port).start()
        try:
            return self._loop()
        finally:
            supervisor.stop()
            if self.unsaved is not None and not self._save_state():
                log.error(
                    "the batch state of job %s was never saved (%s): a requeued job starts "
                    "from the last state saved in %s",
                    self.job_id,
                    self.unsaved,
                    self.spec.ckpt_dir,
                )

    def _loop(self) -> BatchExit:
        nodes = self.usable()
        if len(nodes) < self.spec.nodes:
            return self._requeue(f"{len(nodes)} usable nodes, {self.spec.nodes} needed")
        while True:
            self._keep(replace(self.state, step_launches=self.state.step_launches + 1))
            log.info("agent step %d on %s", self.state.step_launches, ",".join(nodes))
            self._report(nodes)
            returncode = self._run_step(nodes)
            if self.save_requested.is_set():
                return self._save_and_requeue_done()
            # Stopped at the cap: give up with the count that reached it (the failures of the
            # stop itself are not the run's); else charge what the step went through.
            budget = self.step_spent or self._charge_in_place_restarts()
            if budget.exhausted:
                return self._give_up(budget.stop_reason())
            outcomes = self._read_outcomes()
            decision = after_step(
                returncode,
                self.usable(),
                self.spec,
                self.state.budget,
                self._note_checkpoint(),
                outcomes,
            )
            self._keep(replace(self.state, budget=decision.budget).noted(decision.reason))
            log.info("%s", decision.reason)
            if decision.move is Move.FINISH:
                return BatchExit.FINISHED
            if decision.move is Move.GIVE_UP:
                return BatchExit.GIVE_UP
            if decision.move is Move.REQUEUE:
                return self._requeue(decision.reason)
            nodes = list(decision.nodes)

    def _report(self, nodes: Sequence[str]) -> None:
        """The allocation to the daemon, when the step's nodes are new (never blocks: the
        reporter sends it, and resends it until the daemon has it)."""
        if self.report_allocation is None or tuple(nodes) == self.reported_nodes:
            return
        self.reported_nodes = tuple(nodes)
        self.report_allocation(allocation_report(self.job_id, nodes, self.spec.nodes))

    def _run_step(self, nodes: Sequence[str]) -> int:
        self.outcome_dir = self._new_outcome_dir()
        self.step_before = self.state.budget
        self.step_seen, self.step_gone, self.step_stopped_at = [], set(), None
        self.step_spent, self.finished_seen_at = None, None
        agent = self.spec.agent_argv(self.store_host, self.outcome_dir)
        argv = srun_argv(nodes, agent, self.spec.step_options())
        step = subprocess.Popen(argv)
        next_check = time.monotonic() + self.poll_s
        while step.poll() is None:
            if self.save_requested.is_set():
                self._coordinated_save(step)
                return self._stop(step)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.poll_s
                if self.unsaved is not None:
                    self._save_state()  # the filesystem may have room again
                if self._step_cannot_recover(nodes):
                    return self._stop(step)
                if self._budget_spent() or self._finished_elsewhere():
                    return self._stop(step)
            time.sleep(0.2)
        return int(step.returncode)

    def _finished_elsewhere(self) -> bool:
        """An agent's torchrun succeeded: training is done, and the other agents end within
        moments. One that does not (seen: a worker that aborted at its exit, whose torchrun
        then waits for a round no peer will join) is stopped after `finish_grace_s`."""
        if not self._read_outcomes().finished:
            return False
        now = time.monotonic()
        if self.finished_seen_at is None:
            self.finished_seen_at = now
            log.info("training finished on an agent: the others have %.0f s to end",
                     self.finish_grace_s)  # fmt: skip
        return now - self.finished_seen_at >= self.finish_grace_s

    def _budget_spent(self) -> bool:
        """The step's in-place restarts spent the budget, and the daemon, if it watches the run,
        did not stop it within `give_up_grace_s` (it cancels the job, which ends this step).
        A node loss confirmed during the grace (`_note_removed`: Slurm calls a node lost
        seconds after its peers' restart is recorded) can make the restart that spent it free:
        then it is no longer spent."""
        budget = self._charge_in_place_restarts()
        if self.step_spent is not None and not budget.exhausted:
            log.info(
                "restart budget no longer spent: a node lost since caused the restart "
                "(%d in a row without progress, cap %d)",
                budget.restarts_without_progress,
                budget.max_restarts_without_progress,
            )
            self.step_spent = None
        if self.step_spent is None:
            if not budget.exhausted:
                return False
            # Kept as it is now: the failures of the grace period and of the stop add nothing
            # (charge_step reads the budget at the failure that spent it).
            self.step_spent, self.step_spent_at = budget, time.monotonic()
            log.warning(
                "restart budget spent (%s): stopping the agent step in %.0f s",
                budget.stop_reason(),
                self.give_up_grace_s,
            )
        return time.monotonic() - self.step_spent_at >= self.give_up_grace_s

    def _charge_in_place_restarts(self) -> RestartBudget:
        """The budget after the current step's in-place restarts so far (kept in the state, so
        it survives a requeue and the next step starts from it)."""
        self._note_checkpoint()
        recorded = read_step(self.outcome_dir, left_before=self.step_stopped_at)
        budget = charge_step(self.step_before, [*recorded, *self.step_seen])
        kept = self.state.budget
        if budget.restarts_without_progress != kept.restarts_without_progress:
            log.info(
                "in-place restarts: %d in a row without a newer checkpoint (cap %d)",
                budget.restarts_without_progress,
                budget.max_restarts_without_progress,
            )
        if (budget.restarts_without_progress, budget.last_progress) != (
            kept.restarts_without_progress,
            kept.last_progress,
        ):
            self._keep(replace(self.state, budget=budget))
        return budget

    def _keep(self, state: BatchState) -> None:
        """The new state, saved at once: a batch host killed now resumes from it. When it
        cannot be saved it is kept, and saved at the next poll or change (`_save_state`)."""
        self.state = state
        self._save_state()

    def _save_state(self) -> bool:
        """Save the current state; a full or read-only checkpoint filesystem is logged (once
        until a save succeeds again) and leaves ``unsaved`` set, never stops the batch step."""
        try:
            self.state.save(self.spec.ckpt_dir)
        except OSError as error:
            why = _why(error)
            if self.unsaved is None:
                log.error(
                    "cannot save the batch state in %s (%s): supervising on, saving again "
                    "at every poll",
                    self.spec.ckpt_dir,
                    why,
                )
            self.unsaved = why
            return False
        if self.unsaved is not None:
            log.warning(
                "batch state saved again in %s (it was not: %s)", self.spec.ckpt_dir, self.unsaved
            )
            self.unsaved = None
        return True

    def _note_checkpoint(self) -> str:
        """A complete checkpoint under the checkpoint directory is progress even where the
        script reports none (slurmft.core.checkpoints: any script's layout); the daemon is
        told of one the ranks did not report. Returns its label ("" before any)."""
        found = self.checkpoints.poll()
        if found is None:
            return ""
        if found.label != self.checkpoint_seen:
            self.checkpoint_seen = found.label
            at = datetime.now(UTC)
            self.step_seen.append(
                Sighting(Seen.CHECKPOINT, at, step=found.ordinal, label=found.label)
            )
            if found.layout != "slurmft" and self.report_event is not None:
                self.report_event(file_checkpoint_event(found, at))
        return found.label

    def _note_removed(self, nodes: Sequence[str], alive: set[str]) -> None:
        """Nodes of the step that Slurm took away (or that were cordoned): as in the daemon, a
        restart near their loss is free."""
        for name in sorted(set(nodes) - alive - self.step_gone):
            self.step_gone.add(name)
            self.step_seen.append(Sighting(Seen.NODE_REMOVED, datetime.now(UTC)))

    def _give_up(self, reason: str) -> BatchExit:
        self._keep(self.state.noted(reason))
        log.error("giving up: %s", reason)
        return BatchExit.GIVE_UP

    def _silent_unconfirmed(self, job_nodes: Sequence[str], info: dict[str, NodeInfo]) -> set[str]:
        """The job's nodes Slurm calls not responding (not DOWN) for less than `confirm_s`:
        still the step's until it is confirmed (docs/design.md, the confirmed Slurm fact)."""
        now = datetime.now(UTC)
        since = self.lost.update(info, now)
        silent = silent_nodes(job_nodes, info)
        young = {name for name in silent if (now - since[name]).total_seconds() < self.confirm_s}
        for name in sorted(young - self.cordoned):
            log.info("Slurm calls %s not responding: not confirmed yet, the step keeps it", name)
        return young - self.cordoned

    def _step_cannot_recover(self, nodes: Sequence[str]) -> bool:
        """Fewer than N of the step's nodes left: the survivors would wait out the rendezvous
        timeout for a node that is gone; end the step and relaunch on what is usable now."""
        self._read_outcomes()  # an agent that left mid-step took its node with it
        try:
            job = self.client.job(self.job_id)
            info = self.client.nodes(job.nodes)
        except SlurmError as error:
            log.warning("Slurm unreachable (%s): keeping the agent step", error)
            return False
        usable = usable_nodes(job.nodes, info, sorted(self.cordoned))
        alive = (set(usable) | self._silent_unconfirmed(job.nodes, info)) & set(nodes)
        self._note_removed(nodes, alive)
        if len(alive) < self.spec.nodes:
            log.warning(
                "only %d of the step's nodes left (%d needed): ending the step",
                len(alive),
                self.spec.nodes,
            )
            return True
        return False

    def _stop(self, step: subprocess.Popen[bytes]) -> int:
        """SIGTERM to the agents themselves (`scancel --signal=TERM`, steps only), so each stops
        its workers. Not to srun: srun answers SIGTERM by aborting the step, which SIGKILLs the
        agents and leaves their workers running on (measured on 22.05)."""
        self.step_stopped_at = datetime.now(UTC)
        try:
            self.client.signal(self.job_id, "TERM", SignalTarget.STEPS)
        except SlurmError as error:
            log.warning("could not signal the agent step (%s)", error)
        try:
            return int(step.wait(timeout=self.stop_grace_s))
        except subprocess.TimeoutExpired:
            step.kill()
            # The next agent step shares the CPUs (srun --overlap): no agent of this one may
            # live on beside it.
            try:
                self.client.signal(self.job_id, "KILL", SignalTarget.STEPS)
            except SlurmError as error:
                log.warning("could not kill the agent step (%s)", error)
            return int(step.wait(timeout=30))

    def _coordinated_save(self, step: subprocess.Popen[bytes]) -> None:
        before = newest_checkpoint(self.spec.ckpt_dir)
        step.send_signal(signal.SIGUSR1)  # srun forwards USR1 to every agent
        deadline = time.monotonic() + self.spec.save_timeout_s
        while time.monotonic() < deadline and newest_checkpoint(self.spec.ckpt_dir) <= before:
            if step.poll() is not None:
                break
            time.sleep(0.5)
        saved = newest_checkpoint(self.spec.ckpt_dir)
        log.info("coordinated save: %s", saved if saved > before else "none in time")

    def _wait_until_silent_nodes_are_down(self) -> None:
        """A GRES job is requeued only once every node it holds whose slurmd is silent is DOWN
        (Slurm 22.05 breaks the GPUs of a job requeued holding one: docs/slurm.md). The batch
        step may not set DOWN itself: the daemon does within a poll, Slurm after SlurmdTimeout.
        Bounded by fence_wait_s; then it requeues anyway, and says so."""
        deadline = time.monotonic() + self.fence_wait_s
        said = ""
        while True:
            try:
                job = self.client.job(self.job_id)
                info = self.client.nodes(job.nodes)
            except SlurmError as error:
                log.warning("cannot see whether the job's silent nodes are DOWN (%s)", error)
                return
            silent = ",".join(silent_nodes(job.nodes, info))
            if not silent:
                return
            if time.monotonic() >= deadline:
                log.error(
                    "requeueing while %s is still not DOWN after %.0f s: the next attempt's "
                    "GPU steps may be refused",
                    silent,
                    self.fence_wait_s,
                )
                return
            if silent != said:
                log.info(
                    "waiting for %s to be DOWN before the requeue (a GPU job requeued "
                    "holding it loses its GPUs)",
                    silent,
                )
                said = silent
            time.sleep(min(self.poll_s, 1.0))

    def _save_and_requeue_done(self) -> BatchExit:
        # The budget is untouched: time limits are expected.
        self._keep(self.state.noted("time limit: saved and requeued"))
        return self._requeue("time limit or preemption")

    def _requeue(self, reason: str) -> BatchExit:
        self._keep(replace(self.state, requeues=self.state.requeues + 1))
        if self.spec.step_gres:
            self._wait_until_silent_nodes_are_down()
        log.warning("requeueing job %s: %s", self.job_id, reason)
        try:
            self.client.requeue(self.job_id)
        except SlurmError as error:
            log.error("requeue failed (%s): the controller must requeue", error)
        return BatchExit.REQUEUE
