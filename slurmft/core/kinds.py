"""What happened and what was done about it: the stored values of events and actions.

Every value here is stored (as its string, without a CHECK constraint: a new member needs no
migration) and sent on the wire; a value never changes once released.
"""

from __future__ import annotations

import enum


class NodeRole(enum.StrEnum):
    """A node's part in an attempt's allocation."""

    ACTIVE = "active"  # trains
    SPARE = "spare"  # waits in the rendezvous to take a lost node's place


class FaultClass(enum.StrEnum):
    """Why a restart happened; restarts are counted per class."""

    HARDWARE = "hardware"  # a node or GPU failed
    HANG = "hang"
    STRAGGLER = "straggler"
    USER_CODE = "user_code"
    NUMERICAL = "numerical"  # the loss or the gradients went non-finite
    PREEMPTION = "preemption"
    TIME_LIMIT = "time_limit"
    INFRASTRUCTURE = "infrastructure"  # rendezvous store, report channel, Slurm itself
    UNKNOWN = "unknown"


class EventKind(enum.StrEnum):
    """Something observed about a run: a failure, evidence of one, or progress."""

    RANK_FAILURE = "rank_failure"
    NODE_LOST = "node_lost"
    GPU_FAULT = "gpu_fault"
    HANG = "hang"
    STRAGGLER = "straggler"
    BATCH_HOST_DOWN = "batch_host_down"
    PREFLIGHT_FAILED = "preflight_failed"
    # A spare that would not join: the wait-list fix does not know this torch. Not a failure
    # of its node (never in the failure views, never lemon evidence).
    SPARE_REFUSED = "spare_refused"
    # An agent stopped by a signal (the batch step relaunching its step, Slurm requeueing or
    # cancelling the job) or by the controller's `leave`: its node was alive to say so, so this
    # is never a failure of that node (never in the failure views, never lemon evidence).
    AGENT_STOPPED = "agent_stopped"
    CHANNEL_SILENT = "channel_silent"
    PREEMPTED = "preempted"
    TIME_LIMIT = "time_limit"
    COLLECTIVE_ERROR = "collective_error"  # a rank saw a peer fail: evidence, not a failure
    # A node's launcher found a watched peer's rendezvous heartbeat silent and evicted it from
    # the rendezvous (slurmft.agent.peer_detector): evidence about that peer, like
    # collective_error; the daemon's own evidence (Slurm, the agents' reports) decides a loss.
    PEER_DEAD = "peer_dead"
    # This node was declared dead by its peers and ran again (a frozen node that thawed): its
    # launcher stopped everything below it before it could train or write, and its agent left.
    FENCED = "fenced"
    # This node's torchrun ended with a failure code (not fenced, not a refused spare): training
    # stopped here. Evidence, like collective_error: the cause is found elsewhere. A batch host
    # that dies takes its rendezvous store with it, and every other node's torchrun exits within
    # a second or two, often before any rank has reported the dead peer.
    LAUNCHER_FAILED = "launcher_failed"
    RESTART = "restart"  # workers restarted (in place, spare joined, new step, requeue, new job)
    CHECKPOINT = "checkpoint"  # a verified checkpoint: progress
    # A rank's loss (or gradients) went non-finite (slurmft.train.numerical): re-run once in
    # place; reproduced, it is numerical (the run's policy applied: record, skip, stop); not
    # reproduced, a suspected hardware fault of the rank's node (lemon evidence).
    NUMERICAL_FAULT = "numerical_fault"
    # The daemon could not observe, decide or act for this run in a control pass (bad data, a
    # bug): the error is the message; the pass went on for the other runs.
    CONTROL_ERROR = "control_error"
    # The batch step's report of its job and nodes (protocol.AllocationReport), judged against
    # Slurm: foreign when Slurm does not confirm it (the daemon's event says why).
    ALLOCATION = "allocation"


# The failures that stop training (slurmft.core.goodput measures what each cost): a straggler
# slows it, a preflight failure is a node that never trained, and an agent stopped by slurmft
# itself is neither.
OUTAGE_KINDS = (
    EventKind.RANK_FAILURE,
    EventKind.NODE_LOST,
    EventKind.GPU_FAULT,
    EventKind.HANG,
    EventKind.BATCH_HOST_DOWN,
)


class ActionKind(enum.StrEnum):
    """Something the daemon did (or planned, or was not allowed to do), always with a reason."""

    SUBMIT = "submit"
    DRAIN_NODE = "drain_node"
    RESUME_NODE = "resume_node"
    DOWN_NODE = "down_node"
    EVICT_NODE = "evict_node"
    AGENT_LEAVE = "agent_leave"
    RESTART_WORKERS = "restart_workers"
    REQUEUE = "requeue"
    EXCLUDE_NODES = "exclude_nodes"  # a waiting job's ExcNodeList set to the run's removed nodes
    RESUBMIT = "resubmit"
    CANCEL = "cancel"
    SIGNAL = "signal"
    STOP_RUN = "stop_run"
    FINISH_RUN = "finish_run"
    NOTIFY = "notify"
    DENYLIST_ADD = "denylist_add"
    DENYLIST_REMOVE = "denylist_remove"
    # A request refused by an endpoint (a bad or slow request, a server at its cap), recorded
    # where its run or user is known: the audit of who was turned away and why.
    REFUSE_REQUEST = "refuse_request"
    # A run whose part of the control pass failed pass after pass is no longer tried, until an
    # admin releases it (slurmft.controller.pass_health).
    HOLD_RUN = "hold_run"
    RELEASE_RUN = "release_run"


class ActionStatus(enum.StrEnum):
    PLANNED = "planned"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"  # observe-only mode, or not permitted (recorded with the reason)
