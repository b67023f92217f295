"""What the controller observes (inputs of ``decide``) and what it may do (its outputs).

Plain frozen dataclasses: ``observe`` builds the views from Slurm, the store and the agents'
reports; ``decide`` turns them into actions; ``act`` executes and records them. Keeping these
types free of I/O is what lets the policy be tested as a table and replayed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from slurmft.controller.detect import RankBeat as RankBeat  # re-exported: a view's parts
from slurmft.controller.detect import RankCompute as RankCompute
from slurmft.core.budget import ChargedRestart, RestartBudget, Sighting
from slurmft.core.kinds import EventKind, FaultClass, NodeRole
from slurmft.core.states import JobPhase as JobPhase  # re-exported: observe and decide use it
from slurmft.core.states import RunState
from slurmft.gpu.api import FaultAction
from slurmft.gpu.lemons import XidOccurrence

# --- observations ---------------------------------------------------------------------------


class NodeCondition(StrEnum):
    OK = "ok"
    LOST = "lost"  # DOWN, NOT_RESPONDING, or gone from the job
    DRAINED_BY_OTHERS = "drained_by_others"  # someone else's drain: never undone by slurmft


class JobEnd(StrEnum):
    FINISHED = "finished"  # the batch step says the training script completed
    GIVE_UP = "give_up"  # the batch step stopped at the restart budget (BatchExit.GIVE_UP)
    TIME_LIMIT = "time_limit"
    PREEMPTED = "preempted"
    CANCELLED = "cancelled"
    FAILED = "failed"
    NODE_FAIL = "node_fail"


@dataclass(frozen=True)
class NodeView:
    name: str
    role: NodeRole
    condition: NodeCondition = NodeCondition.OK
    # LOST: when Slurm was first seen calling it lost in an unbroken series of passes; None when
    # that is not in doubt (DOWN and taken out of the job, no longer listed, no history kept).
    lost_since: datetime | None = None


@dataclass(frozen=True)
class GpuFault:
    node: str
    action: FaultAction  # from the GPU classification table (slurmft.gpu.xids)
    description: str  # e.g. "Xid 79 GPU fell off the bus (GPU 3)"
    xid: int | None = None
    gpu: int | None = None
    event_id: int | None = None  # the agent's report, already an event row in the store

    @property
    def key(self) -> str:
        if self.event_id is not None:
            return f"gpu:{self.event_id}"
        return f"gpu:{self.node}:{self.gpu}:{self.xid}:{self.description}"


@dataclass(frozen=True)
class AgentSeen:
    """When a node's agent last reported for the run (its newest batch). Agents report at least
    every few seconds, idle ones included (a keep-alive), so a silent one is frozen or gone."""

    node: str
    last_report_at: datetime


@dataclass(frozen=True)
class JobView:
    job_id: str
    phase: JobPhase
    end: JobEnd | None = None
    batch_host: str | None = None
    batch_host_down: bool = False
    batch_host_lost_since: datetime | None = None  # as NodeView.lost_since
    # Nodes the job holds whose slurmd is silent, not DOWN yet: a job whose steps ask for GRES
    # is never requeued holding one (Slurm 22.05 breaks its GPUs: docs/slurm.md).
    silent_nodes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RestartEvidence:
    """What the store holds about a run's restarts since its newest progress: gather reads it,
    decide counts it (`decide.count_restarts`). Read from a cause window before the progress
    (restarts) and two (causes): progress may come seconds after a restart whose node Slurm
    has not called lost yet, and a restart's cause may come a window after it."""

    since: datetime  # the progress counted so far (runs.last_progress_at), or the run's start
    progress_at: datetime | None = None  # runs.last_progress_at as stored
    progress: Sighting | None = None  # the first report of the newest checkpoint since `since`
    restarts: tuple[Sighting, ...] = ()  # failures, restarts and earlier failed jobs
    causes: tuple[Sighting, ...] = ()  # nodes lost or taken out of the run, hangs killed
    # The daemon's `restart` events already recorded: restart key -> (cause, free).
    recorded: Mapping[str, tuple[FaultClass | None, bool]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunView:
    run_id: str
    nodes_needed: int
    job: JobView | None
    nodes: tuple[NodeView, ...] = ()
    beats: tuple[RankBeat, ...] = ()  # empty for a script that never imports slurmft.train
    compute: tuple[RankCompute, ...] = ()
    gpu_faults: tuple[GpuFault, ...] = ()
    # Why the run's workers stopped on a reproduced numerical fault (its policy: stop), if so.
    numerical_stop: str | None = None
    agents: tuple[AgentSeen, ...] = ()  # nodes whose agent reported in this attempt
    excluded: frozenset[str] = frozenset()  # nodes already out of this run
    steps_ask_gres: bool = False  # its agent steps ask for GRES (GPUs) on each node
    # The count as stored (runs.restarts_without_progress); with `restarts`, decide counts anew.
    budget: RestartBudget = field(default_factory=RestartBudget)
    # When decide's count first read the budget spent (`slurmft.core.budget.spent_at`).
    budget_spent_at: datetime | None = None
    restarts: RestartEvidence | None = None  # None: the run has ended, nothing to count
    cancel_requested: bool = False
    # Findings already recorded (by key), so a condition that lasts is acted on once.
    reported: frozenset[str] = frozenset()
    # Its part of the control pass failed pass after pass (controller.pass_health): nothing
    # but its owner's cancel is decided for it.
    held: bool = False


@dataclass(frozen=True)
class ClusterView:
    now: datetime
    slurm_reachable: bool
    runs: tuple[RunView, ...] = ()
    denylist: frozenset[str] = frozenset()  # kept out of every run
    drains_last_hour: int = 0
    partition_nodes: int = 0
    drained_nodes: int = 0
    # Every run's Xids of the lemon window (slurmft.gpu.lemons.LEMON_WINDOW), this tick's
    # included: decide judges lemons from them.
    xid_history: tuple[XidOccurrence, ...] = ()
    # Straggler windows flagged per node so far (this tick's not included).
    straggler_windows: dict[str, int] = field(default_factory=dict)
    # Since when the daemon has been listening to agents (its start): a silence is counted from
    # then at the earliest. While it was down every agent was silent to it, and each one's
    # buffered reports arrive when its own retry comes round, not all at once.
    listening_since: datetime | None = None

    def heard(self, at: datetime) -> datetime:
        """When something last heard from at ``at`` counts as heard from, for its silence."""
        if self.listening_since is None:
            return at
        return max(at, self.listening_since)


# --- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """Base of every action: which run (if any), and why, with the evidence."""

    run_id: str | None
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class RecordEvent(Action):
    kind: EventKind = EventKind.RANK_FAILURE
    fault_class: FaultClass | None = None
    node: str | None = None
    rank: int | None = None
    key: str = ""  # the finding's key; recorded so the next tick does not repeat it


@dataclass(frozen=True)
class RecordRestarts(Action):
    """The run's restarts as counted now: its budget's count and the progress it counts from
    (the run's row), and one daemon `restart` event per restart, recorded or corrected (a
    restart is counted at its first report, often before its node loss is known)."""

    restarts_without_progress: int = 0
    last_progress_at: datetime | None = None
    restarts: tuple[ChargedRestart, ...] = ()
    # Only the progress moved (a healthy run, every pass): logged at debug, not as news.
    progress_only: bool = False


@dataclass(frozen=True)
class ExcludeNode(Action):
    """Keep the node out of this run: its agent leaves, a spare takes its place, later steps,
    requeues and submissions exclude it."""

    node: str = ""


@dataclass(frozen=True)
class DrainNode(Action):
    """Drain in Slurm for everyone (trust policy and rate limits already applied) and denylist."""

    node: str = ""


@dataclass(frozen=True)
class EvictNode(Action):
    """Set the node DOWN in Slurm: under --no-kill the running job shrinks to its other nodes
    (not requeued, measured on 22.05; docs/slurm.md). A DrainNode before it keeps it out."""

    node: str = ""


@dataclass(frozen=True)
class RestartWorkers(Action):
    """Tell the node's agent to save its workers' stacks and kill them; torchrun restarts them."""

    node: str = ""


@dataclass(frozen=True)
class RequeueJob(Action):
    job_id: str = ""
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ExcludeFromJob(Action):
    """Set a waiting job's excluded nodes (ExcNodeList) in Slurm to these."""

    job_id: str = ""
    nodes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class SubmitAttempt(Action):
    """A new Slurm job for the run (its job cannot be requeued), resuming from its checkpoint."""

    exclude: frozenset[str] = frozenset()
    restarts_without_progress: int | None = None  # the run's budget after this restart, if charged


@dataclass(frozen=True)
class FinishRun(Action):
    state: RunState = RunState.COMPLETED
    job_id: str | None = None  # cancel this job too (a run stopped at the cap)


@dataclass(frozen=True)
class NotifyHuman(Action):
    """Something needs a person: shown in `slurmft status` and sent to the webhook."""
