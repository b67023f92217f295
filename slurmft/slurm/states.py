"""Every Slurm job and node state, and what each means to slurmft, in one table each.

Slurm spells states several ways: `squeue -o %T` prints `RUNNING`, `squeue -o %t` prints `R`,
`sacct` prints `CANCELLED by 0`, newer `--json` prints a list (`["PENDING", "REQUEUED"]`); nodes
come as `sinfo` words with suffix characters (`down*`, `idle~`, `allocated+`, `drained`), as
`scontrol` compounds (`IDLE+DRAIN+NOT_RESPONDING`) or as JSON lists. Everything is read here and
nowhere else, so a new spelling is one table row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from slurmft.core.states import JobPhase as JobPhase  # re-exported: slurmft.slurm names it


class JobState(StrEnum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    RESIZING = "RESIZING"
    COMPLETING = "COMPLETING"
    STAGE_OUT = "STAGE_OUT"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REVOKED = "REVOKED"
    UNKNOWN = "UNKNOWN"

    @property
    def phase(self) -> JobPhase:
        return _JOB_TABLE[self][1]

    @property
    def short_code(self) -> str:
        return _JOB_TABLE[self][0]

    @property
    def is_ended(self) -> bool:
        return self.phase is JobPhase.ENDED

    @property
    def holds_nodes(self) -> bool:
        return self.phase is JobPhase.ACTIVE

    @property
    def lost_a_node(self) -> bool:
        """Ended because a node failed (not because the program failed)."""
        return self in (JobState.NODE_FAIL, JobState.BOOT_FAIL)


# state -> (squeue %t short code, phase). SPECIAL_EXIT is a requeue-held job the user must
# release; REQUEUE_HOLD likewise: both wait. COMPLETING still holds nodes (processes being reaped).
_JOB_TABLE: dict[JobState, tuple[str, JobPhase]] = {
    JobState.PENDING: ("PD", JobPhase.WAITING),
    JobState.REQUEUED: ("RQ", JobPhase.WAITING),
    JobState.REQUEUE_HOLD: ("RH", JobPhase.WAITING),
    JobState.REQUEUE_FED: ("RF", JobPhase.WAITING),
    JobState.RESV_DEL_HOLD: ("RD", JobPhase.WAITING),
    JobState.SPECIAL_EXIT: ("SE", JobPhase.WAITING),
    JobState.CONFIGURING: ("CF", JobPhase.ACTIVE),
    JobState.RUNNING: ("R", JobPhase.ACTIVE),
    JobState.SUSPENDED: ("S", JobPhase.ACTIVE),
    JobState.STOPPED: ("ST", JobPhase.ACTIVE),
    JobState.SIGNALING: ("SI", JobPhase.ACTIVE),
    JobState.RESIZING: ("RS", JobPhase.ACTIVE),
    JobState.COMPLETING: ("CG", JobPhase.ACTIVE),
    JobState.STAGE_OUT: ("SO", JobPhase.ACTIVE),
    JobState.COMPLETED: ("CD", JobPhase.ENDED),
    JobState.CANCELLED: ("CA", JobPhase.ENDED),
    JobState.FAILED: ("F", JobPhase.ENDED),
    JobState.TIMEOUT: ("TO", JobPhase.ENDED),
    JobState.NODE_FAIL: ("NF", JobPhase.ENDED),
    JobState.PREEMPTED: ("PR", JobPhase.ENDED),
    JobState.BOOT_FAIL: ("BF", JobPhase.ENDED),
    JobState.DEADLINE: ("DL", JobPhase.ENDED),
    JobState.OUT_OF_MEMORY: ("OOM", JobPhase.ENDED),
    JobState.REVOKED: ("RV", JobPhase.ENDED),
    JobState.UNKNOWN: ("?", JobPhase.UNKNOWN),
}

_JOB_BY_NAME = {state.value: state for state in JobState} | {
    code: state for state, (code, _) in _JOB_TABLE.items() if code != "?"
}

# A job state word that Slurm prints *instead of* the base state when the flag is set, in the order
# Slurm's job_state_string() tests them. Newer --json lists the base state and these flags.
_JOB_FLAG_PRECEDENCE = [
    JobState.COMPLETING,
    JobState.STAGE_OUT,
    JobState.CONFIGURING,
    JobState.RESIZING,
    JobState.REQUEUED,
    JobState.REQUEUE_FED,
    JobState.REQUEUE_HOLD,
    JobState.SPECIAL_EXIT,
    JobState.STOPPED,
    JobState.REVOKED,
    JobState.RESV_DEL_HOLD,
    JobState.SIGNALING,
]


def parse_job_state(value: str | Iterable[str]) -> JobState:
    """`RUNNING`, `R`, `CANCELLED by 0`, `["PENDING", "REQUEUED"]` -> a JobState (or UNKNOWN)."""
    if isinstance(value, str):
        words = value.split()
        return _JOB_BY_NAME.get(words[0].upper(), JobState.UNKNOWN) if words else JobState.UNKNOWN
    states = [_JOB_BY_NAME.get(word.upper(), JobState.UNKNOWN) for word in value]
    for flag in _JOB_FLAG_PRECEDENCE:
        if flag in states:
            return flag
    known = [state for state in states if state is not JobState.UNKNOWN]
    return known[0] if known else JobState.UNKNOWN


# --- nodes --------------------------------------------------------------------------------------


class NodeBase(StrEnum):
    """The base state of a node: exactly one at a time."""

    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    DOWN = "DOWN"
    ERROR = "ERROR"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"


class NodeFlag(StrEnum):
    """Flags on top of the base state (any number)."""

    DRAIN = "DRAIN"
    NOT_RESPONDING = "NOT_RESPONDING"
    COMPLETING = "COMPLETING"
    FAIL = "FAIL"
    MAINTENANCE = "MAINTENANCE"
    RESERVED = "RESERVED"
    PLANNED = "PLANNED"
    POWERED_DOWN = "POWERED_DOWN"
    POWERING_UP = "POWERING_UP"
    POWER_DOWN = "POWER_DOWN"  # pending power down
    POWERING_DOWN = "POWERING_DOWN"
    REBOOT_REQUESTED = "REBOOT_REQUESTED"
    REBOOT_ISSUED = "REBOOT_ISSUED"
    INVALID_REG = "INVALID_REG"
    CLOUD = "CLOUD"
    DYNAMIC = "DYNAMIC"
    PERFCTRS = "PERFCTRS"


# sinfo's suffix characters (man sinfo, NODE STATE CODES).
_SUFFIX_FLAGS: dict[str, NodeFlag] = {
    "*": NodeFlag.NOT_RESPONDING,
    "~": NodeFlag.POWERED_DOWN,
    "#": NodeFlag.POWERING_UP,
    "!": NodeFlag.POWER_DOWN,
    "%": NodeFlag.POWERING_DOWN,
    "$": NodeFlag.MAINTENANCE,
    "@": NodeFlag.REBOOT_REQUESTED,
    "^": NodeFlag.REBOOT_ISSUED,
    "-": NodeFlag.PLANNED,
}

# Words sinfo (long %T and short %t forms) and scontrol print for a base+flags combination.
# `drained` means DRAIN with no job left, `draining` DRAIN with jobs: the base is chosen to match.
_NODE_WORDS: dict[str, tuple[NodeBase | None, frozenset[NodeFlag]]] = {
    "IDLE": (NodeBase.IDLE, frozenset()),
    "ALLOCATED": (NodeBase.ALLOCATED, frozenset()),
    "ALLOC": (NodeBase.ALLOCATED, frozenset()),
    "MIXED": (NodeBase.MIXED, frozenset()),
    "MIX": (NodeBase.MIXED, frozenset()),
    "DOWN": (NodeBase.DOWN, frozenset()),
    "ERROR": (NodeBase.ERROR, frozenset()),
    "FUTURE": (NodeBase.FUTURE, frozenset()),
    "FUTR": (NodeBase.FUTURE, frozenset()),
    "UNKNOWN": (NodeBase.UNKNOWN, frozenset()),
    "UNK": (NodeBase.UNKNOWN, frozenset()),
    "DRAINED": (NodeBase.IDLE, frozenset({NodeFlag.DRAIN})),
    "DRAINING": (NodeBase.ALLOCATED, frozenset({NodeFlag.DRAIN})),
    "DRNG": (NodeBase.ALLOCATED, frozenset({NodeFlag.DRAIN})),
    "FAILING": (NodeBase.ALLOCATED, frozenset({NodeFlag.FAIL})),
    "FAILG": (NodeBase.ALLOCATED, frozenset({NodeFlag.FAIL})),
    "MAINT": (None, frozenset({NodeFlag.MAINTENANCE})),
    "RESV": (None, frozenset({NodeFlag.RESERVED})),
    "PLND": (None, frozenset({NodeFlag.PLANNED})),
    "COMP": (None, frozenset({NodeFlag.COMPLETING})),
    "INVAL": (None, frozenset({NodeFlag.INVALID_REG})),
    "NPC": (None, frozenset({NodeFlag.PERFCTRS})),
    "POW_DN": (None, frozenset({NodeFlag.POWERED_DOWN})),
    "POWER_DOWN": (None, frozenset({NodeFlag.POWER_DOWN})),
    "POW_UP": (None, frozenset({NodeFlag.POWERING_UP})),
    "POWER_UP": (None, frozenset({NodeFlag.POWERING_UP})),
    "BOOT": (None, frozenset({NodeFlag.REBOOT_ISSUED})),
    "REBOOT": (None, frozenset({NodeFlag.REBOOT_REQUESTED})),
    # "drain" is sinfo %t's short form of drained; in scontrol compounds DRAIN is the flag.
    "DRAIN": (None, frozenset({NodeFlag.DRAIN})),
} | {flag.value: (None, frozenset({flag})) for flag in NodeFlag}


@dataclass(frozen=True)
class NodeStatus:
    """A node's base state, its flags, and any words this table does not know (kept, not lost)."""

    base: NodeBase
    flags: frozenset[NodeFlag] = frozenset()
    unknown_words: frozenset[str] = frozenset()

    @property
    def drain_requested(self) -> bool:
        return NodeFlag.DRAIN in self.flags or NodeFlag.FAIL in self.flags

    @property
    def drained(self) -> bool:
        """Drained and empty: no job runs there any more."""
        return self.drain_requested and self.base in (NodeBase.IDLE, NodeBase.DOWN)

    @property
    def draining(self) -> bool:
        return self.drain_requested and self.base in (NodeBase.ALLOCATED, NodeBase.MIXED)

    @property
    def responding(self) -> bool:
        return NodeFlag.NOT_RESPONDING not in self.flags

    @property
    def down(self) -> bool:
        return self.base is NodeBase.DOWN

    @property
    def lost(self) -> bool:
        """Dead as far as its jobs are concerned: DOWN, or its slurmd does not answer."""
        return self.down or not self.responding

    @property
    def silent_not_down(self) -> bool:
        """Its slurmd does not answer, and Slurm has not marked it DOWN yet: a --no-kill job
        still holds it (Slurm takes a node out of such a job only when it is DOWN)."""
        return not self.responding and not self.down

    @property
    def schedulable(self) -> bool:
        """Slurm may place new work here."""
        blocking = {NodeFlag.POWERED_DOWN, NodeFlag.REBOOT_REQUESTED, NodeFlag.INVALID_REG}
        return (
            self.base in (NodeBase.IDLE, NodeBase.MIXED)
            and self.responding
            and not self.drain_requested
            and not (self.flags & blocking)
        )

    def __str__(self) -> str:
        return "+".join([self.base.value, *sorted(self.flags), *sorted(self.unknown_words)])


def parse_node_state(value: str | Iterable[str]) -> NodeStatus:
    """`down*`, `drained`, `allocated+`, `IDLE+DRAIN`, `["IDLE", "DRAIN"]` -> a NodeStatus."""
    words, flags = _node_words(value)
    base: NodeBase | None = None
    unknown: set[str] = set()
    for word in words:
        entry = _NODE_WORDS.get(word)
        if entry is None:
            unknown.add(word)
            continue
        word_base, word_flags = entry
        flags |= word_flags
        # An explicit base (IDLE, DOWN, ...) beats one implied by a sinfo word (drained).
        if word_base is not None and (base is None or word in NodeBase.__members__):
            base = word_base
    if base is None and flags & {NodeFlag.DRAIN, NodeFlag.COMPLETING}:
        # A lone `drain` (sinfo %t for drained) or `completing`: no job is running there.
        base = NodeBase.IDLE
    return NodeStatus(base or NodeBase.UNKNOWN, frozenset(flags), frozenset(unknown))


def _node_words(value: str | Iterable[str]) -> tuple[list[str], set[NodeFlag]]:
    if not isinstance(value, str):
        return [word.strip().upper() for word in value if word.strip()], set()
    text = value.strip()
    flags: set[NodeFlag] = set()
    # Peel sinfo's suffix characters; a trailing "+" on a word (allocated+) means COMPLETING.
    while text and (text[-1] in _SUFFIX_FLAGS or text[-1] == "+"):
        flags.add(_SUFFIX_FLAGS.get(text[-1], NodeFlag.COMPLETING))
        text = text[:-1]
    return [word.upper() for word in text.split("+") if word], flags
