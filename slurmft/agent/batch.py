"""The batch step's plan (pure): the job script, the agent step's srun line, and what to do when
an agent step ends. Effects live in batch_step.py.

Facts behind the flags (docs/measured/local-slurm.md):
- `srun --no-kill`: without it Slurm kills every agent of the step when it marks a dead node
  DOWN, which at a real site (SlurmdTimeout 300 s) is minutes after the spare took over.
- `--kill-on-bad-exit=0`: a site's KillOnBadExit=1 would end the step when one agent leaves.
- explicit `-N/-n` and `--immediate`: in a job shrunk by a node loss, `srun -N <old count>`
  waits forever ("Requested nodes are busy").
- `--overlap`: an agent step that ended after a node loss keeps holding the CPUs of every node
  until Slurm has marked the lost node DOWN (~10 s here, minutes at a site with SlurmdTimeout
  300 s); a new step on the healthy nodes got "Requested nodes are busy" until then. The batch
  step starts a step only after the previous one has ended, so the overlap lets it reuse CPUs
  that nothing uses any more; it never runs two agents of a run on one node.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import IntEnum
from pathlib import Path
from typing import Any

from slurmft.config import PolicySection
from slurmft.core.budget import Restart, RestartBudget, progress_label
from slurmft.core.checkpoints import Checkpoint
from slurmft.core.exits import StepOutcome
from slurmft.core.kinds import EventKind, FaultClass
from slurmft.protocol import AgentEvent
from slurmft.slurm.api import NodeInfo, SubmitRequest
from slurmft.slurm.hostlist import compress
from slurmft.slurm.script import render_batch_script

STATE_FILE = "slurmft-batch-state.json"
MAX_REPORTED_PATH = 512  # a checkpoint's path as the daemon stores it, cut to this
SRUN_IMMEDIATE_S = 60


@dataclass(frozen=True)
class BatchSpec:
    """One run's allocation: N training nodes + S spares, and the user's training command."""

    run_id: str
    nodes: int
    spares: int
    script: tuple[str, ...]  # after torchrun's flags: ("train.py", ...) or ("-m", "pkg", ...)
    ckpt_dir: str  # progress is a newer checkpoint here; the budget lives here across requeues
    store_port: int = 29400
    nproc_per_node: int | str = 1  # or "gpu": the GPUs Slurm gave each node's step
    step_gres: str = ""  # the GRES each agent step asks for on each node, e.g. "gpu:8"
    cpus_per_task: int | None = None  # the CPUs each agent (one task per node) gets
    max_restarts_without_progress: int = PolicySection.max_restarts_without_progress
    save_timeout_s: float = 120.0  # time limit: how long ranks get to save before the requeue
    slurmft: str = "slurmft"  # the slurmft executable on the compute nodes
    token_file: str = ""
    # `python -m slurmft` instead of the executable (submit --python): the batch step's, and
    # the agents' when they run elsewhere (inside a container: that interpreter's path there).
    python: str = ""
    agent_python: str = ""
    agent_wrapper: tuple[str, ...] = ()  # what each agent runs under (apptainer exec, bwrap)
    setup: tuple[str, ...] = ()  # shell lines run before every agent, on every node
    srun_args: tuple[str, ...] = ()  # canonical (slurmft.slurm.passthrough) srun options

    def _command(self, python: str) -> list[str]:
        return [python, "-m", "slurmft"] if python else [self.slurmft]

    def _agent_command(self) -> list[str]:
        """slurmft on each node: under the wrapper, after the setup lines (in a shell that then
        becomes the agent: `exec "$@"`, so signals reach the agent itself)."""
        setup: list[str] = []
        if self.setup:
            lines = "\n".join(("set +u", *self.setup, 'exec "$@"'))
            setup = ["/bin/bash", "-c", lines, "slurmft-setup"]
        return [*self.agent_wrapper, *setup, *self._command(self.agent_python or self.python)]

    def agent_argv(self, store_host: str, outcome_dir: str = "") -> list[str]:
        argv = [
            *self._agent_command(),
            "agent",
            "run",
            f"--nodes={self.nodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--rdzv-endpoint={store_host}:{self.store_port}",
            f"--run-id={self.run_id}",
        ]
        if self.token_file:
            argv.append(f"--token-file={self.token_file}")
        if outcome_dir:
            argv.append(f"--outcome-dir={outcome_dir}")
        return [*argv, "--", *self.script]

    def step_options(self) -> list[str]:
        """What every agent step asks for beyond its nodes: GRES are never given to a step
        implicitly (not even under --exclusive), so each step names them."""
        options = [f"--gres={self.step_gres}"] if self.step_gres else []
        if self.cpus_per_task:
            options.append(f"--cpus-per-task={self.cpus_per_task}")
        return [*self.srun_args, *options]

    def batch_argv(self) -> list[str]:
        """The batch script's one command: `slurmft agent batch ...`."""
        argv = [
            *self._command(self.python),
            "agent",
            "batch",
            f"--run-id={self.run_id}",
            f"--nodes={self.nodes}",
            f"--spares={self.spares}",
            f"--ckpt-dir={self.ckpt_dir}",
            f"--store-port={self.store_port}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts-without-progress={self.max_restarts_without_progress}",
            f"--save-timeout-s={self.save_timeout_s:g}",
        ]
        if self.token_file:
            argv.append(f"--token-file={self.token_file}")
        if self.step_gres:
            argv.append(f"--step-gres={self.step_gres}")
        if self.cpus_per_task:
            argv.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.agent_python and self.agent_python != self.python:
            argv.append(f"--agent-python={self.agent_python}")
        if self.agent_wrapper:
            argv.append(f"--agent-wrapper={shlex.join(self.agent_wrapper)}")
        argv += [f"--setup={line}" for line in self.setup]
        argv += [f"--srun-arg={word}" for word in self.srun_args]
        return [*argv, "--", *self.script]


def job_script(spec: BatchSpec, env: Mapping[str, str] | None = None) -> str:
    """The batch script: ``env`` exported, the setup lines, then the batch step."""
    return render_batch_script(spec.batch_argv(), env=env, setup=spec.setup)


def submit_request(
    spec: BatchSpec,
    *,
    job_name: str,
    time_limit: str | None = None,
    save_lead_s: int = 300,
    exclude: Sequence[str] = (),
    partition: str | None = None,
    output: str | None = None,
    site: Mapping[str, Any] | None = None,
) -> SubmitRequest:
    """`--no-kill --requeue`, and USR1 to the batch shell `save_lead_s` before the time limit;
    ``site``: the run's site options (SubmitRequest's fields of that name)."""
    request = SubmitRequest(
        script=job_script(spec),
        job_name=job_name,
        run_id=spec.run_id,
        nodes=spec.nodes,
        spare_nodes=spec.spares,
        no_kill=True,
        requeue=True,
        exclude=tuple(exclude),
        signal=f"B:USR1@{save_lead_s}" if time_limit else None,
        time_limit=time_limit,
        partition=partition,
        output=output,
        cpus_per_task=spec.cpus_per_task,
    )
    return replace(request, **dict(site or {}))


def srun_argv(
    nodes: Sequence[str], agent_argv: Sequence[str], options: Sequence[str] = ()
) -> list[str]:
    """One agent per node, on exactly these nodes (``options``: `BatchSpec.step_options`)."""
    count = len(nodes)
    return [
        "srun",
        "--no-kill",
        "--kill-on-bad-exit=0",
        "--overlap",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f"--nodelist={compress(nodes)}",
        f"--immediate={SRUN_IMMEDIATE_S}",
        *options,
        *agent_argv,
    ]


def usable_nodes(
    job_nodes: Sequence[str], info: dict[str, NodeInfo], cordoned: Sequence[str] = ()
) -> list[str]:
    """The job's nodes that may run an agent: held by the job now, not lost or draining, not
    cordoned for this run."""
    found = []
    for name in job_nodes:
        node = info.get(name)
        if node is None or node.status.lost or node.status.drain_requested:
            continue
        if name not in cordoned:
            found.append(name)
    return found


# --- what each agent of a step says about how it ended -----------------------------------------
#
# srun reports only the highest exit code of its tasks, so "training finished on the agents that
# trained, and the one the controller told to leave exited 4" reads as a failure, and the batch
# step would relaunch into a rendezvous that is closed. Each agent therefore writes how it ended
# into the step's outcome directory (shared, in the checkpoint directory), and the batch step
# reads them: one agent whose torchrun succeeded means training finished, and an agent that left
# because the controller cordoned its node (or found it unfit) keeps that node out of the
# relaunched steps of this job.


def write_step_outcome(outcome_dir: str, node: str, outcome: StepOutcome, reason: str = "") -> None:
    directory = Path(outcome_dir)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{node}.tmp"
    partial.write_text(json.dumps({"node": node, "outcome": outcome, "reason": reason}))
    os.replace(partial, directory / f"{node}.json")  # the reader sees all of it or nothing


@dataclass(frozen=True)
class StepOutcomes:
    by_node: dict[str, StepOutcome] = field(default_factory=dict)

    @classmethod
    def read(cls, outcome_dir: str) -> StepOutcomes:
        found = {}
        for path in sorted(Path(outcome_dir).glob("*.json")) if outcome_dir else ():
            try:
                record = json.loads(path.read_text())
                found[str(record["node"])] = StepOutcome(record["outcome"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a torn or foreign file says nothing
        return cls(found)

    @property
    def finished(self) -> bool:
        return StepOutcome.FINISHED in self.by_node.values()

    @property
    def cordoned(self) -> frozenset[str]:
        return frozenset(n for n, o in self.by_node.items() if o.cordons)


# --- the batch step's state, kept in the checkpoint directory across requeues ---------------


@dataclass(frozen=True)
class BatchState:
    """What the batch step keeps across requeues: the run's restart budget (the daemon's type,
    `slurmft.core.budget.RestartBudget`) and its own counters. The file is the budget's fields
    (`RestartBudget.to_dict`) and these beside them, one flat JSON object."""

    budget: RestartBudget = field(default_factory=RestartBudget)
    step_launches: int = 0
    requeues: int = 0
    history: tuple[str, ...] = ()

    @classmethod
    def load(cls, ckpt_dir: str, cap: int) -> BatchState:
        """The state in ``ckpt_dir`` (written by this version or by slurmft 0.1's batch step),
        with ``cap``, the job's own, as the budget's cap; a fresh state when there is none."""
        path = Path(ckpt_dir) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls(RestartBudget(max_restarts_without_progress=cap))
        budget = RestartBudget.from_dict(data, cap=cap)
        # slurmft 0.1 kept the checkpoint directory's name; progress compares labels.
        progress = checkpoint_label(budget.last_progress or "") or None
        return cls(
            budget=replace(budget, last_progress=progress),
            step_launches=int(data.get("step_launches", 0)),
            requeues=int(data.get("requeues", 0)),
            history=tuple(str(line) for line in data.get("history", ())),
        )

    def noted(self, reason: str) -> BatchState:
        return replace(self, history=(*self.history, reason))

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.budget.to_dict(),
            "step_launches": self.step_launches,
            "requeues": self.requeues,
            "history": list(self.history),
        }

    def save(self, ckpt_dir: str) -> None:
        path = Path(ckpt_dir) / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(partial, path)  # a batch host killed mid-write leaves the old state


def newest_checkpoint(ckpt_dir: str) -> str:
    """The newest published checkpoint directory's name (slurmft.train: `step-<9 digits>`)."""
    try:
        names = [p.name for p in Path(ckpt_dir).iterdir() if p.name.startswith("step-")]
    except OSError:  # not there (yet), or not readable: no checkpoint seen
        return ""
    return max(names, default="")


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint directory named `step-<digits>`; None for any other name."""
    digits = name.removeprefix("step-")
    # isascii: `isdigit` is true of "²", which int() refuses.
    return (
        int(digits) if name.startswith("step-") and digits.isascii() and digits.isdigit() else None
    )


def checkpoint_label(name: str) -> str:
    """A checkpoint directory's name as the budget's progress: the label the agents' checkpoint
    reports get (`step-000000010` -> `step 10`), so the two compare equal."""
    step = checkpoint_step(name)
    return name if step is None else progress_label(step)


def file_checkpoint_event(found: Checkpoint, at: datetime) -> AgentEvent:
    """What the batch step tells the daemon of a complete checkpoint the script wrote itself:
    no `step` (that is for the ranks' verified checkpoints), its place in time instead."""
    return AgentEvent(
        kind=EventKind.CHECKPOINT,
        occurred_at=at.timestamp(),
        message=f"checkpoint {found.label}",
        details={
            "layout": found.layout,
            "path": found.path[:MAX_REPORTED_PATH],
            "ordinal": found.ordinal,
            "label": found.label[:MAX_REPORTED_PATH],
        },
    )


class Move(IntEnum):
    FINISH = 0
    RELAUNCH = 1
    REQUEUE = 2
    GIVE_UP = 3


@dataclass(frozen=True)
class Decision:
    move: Move
    reason: str
    budget: RestartBudget  # the run's budget after the step
    nodes: tuple[str, ...] = ()


def after_step(  # noqa: PLR0917 (the step's whole result)
    returncode: int,
    usable: Sequence[str],
    spec: BatchSpec,
    budget: RestartBudget,
    checkpoint: str,
    outcomes: StepOutcomes | None = None,
) -> Decision:
    """What follows an agent step that ended with `returncode` (and its agents' `outcomes`),
    and the budget after it. `usable` must already leave out the cordoned nodes."""
    if returncode == 0:
        return Decision(Move.FINISH, "training finished", budget)
    if outcomes is not None and outcomes.finished:
        others = {n: o for n, o in outcomes.by_node.items() if o is not StepOutcome.FINISHED}
        return Decision(
            Move.FINISH,
            f"training finished (agent step exit {returncode}: "
            f"{', '.join(f'{n} {o.lower()}' for n, o in sorted(others.items())) or 'no outcome'})",
            budget,
        )
    # The daemon's own rule (slurmft.core.budget), so the two never disagree.
    budget = budget.charge(Restart(FaultClass.UNKNOWN, progress=checkpoint or None))
    if budget.exhausted:
        return Decision(Move.GIVE_UP, budget.stop_reason(), budget)
    if len(usable) < spec.nodes:
        return Decision(Move.REQUEUE, f"{len(usable)} usable nodes, {spec.nodes} needed", budget)
    return Decision(
        Move.RELAUNCH,
        f"agent step ended with {returncode}: relaunch on {len(usable)} nodes",
        budget,
        tuple(usable),
    )
