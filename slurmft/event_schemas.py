"""What an agent may say in an event: one schema per event kind, checked at the boundary.

An agent's event (protocol.AgentEvent) carries free JSON ``details`` beside its typed fields.
The daemon reads a few of those keys later (a checkpoint's step, a GPU fault's Xid and code, a
restart's rendezvous round), in a control pass that serves every user's runs. So each key the
daemon reads is typed and bounded here, per kind, and ingest refuses an event whose details do
not fit (HTTP 422 naming the item): a value that passed the boundary cannot raise later.

Two more rules close what types alone do not:
- **Kinds only the daemon records** (a node lost, an allocation report, a control error, a
  time limit...) are refused from agents: the batch step's allocation report is a typed field
  of its batch (protocol.AllocationReport), never an event, and every other of these kinds is a
  conclusion the daemon draws from Slurm, not a claim it takes from a job's user.
- **Keys the daemon writes itself** into details (a finding's ``key``, a restart's
  ``restart_key``, the goodput figures, a judged report's verdict) are refused from agents, so
  no report can pass for the daemon's own record.

Keys a schema does not name stay free JSON, bounded in depth and size (protocol's details
check): the daemon keeps them for people and never reads them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from slurmft.core.kinds import EventKind

# The wire's bounds that the schemas share with protocol (which takes them from here: protocol
# imports this module, so these cannot live there).
INT32 = 2**31  # steps, pids, restart counts, Xids, GPU indices: in (-INT32, INT32)
MAX_NODE = 128
MAX_MESSAGE = 65_536
# A bounded text and a bounded whole number: every field the daemon reads is one of these.
Label = Annotated[str, msgspec.Meta(max_length=4096)]
Word = Annotated[str, msgspec.Meta(max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE)]
Int32 = Annotated[int, msgspec.Meta(gt=-INT32, lt=INT32)]
Index32 = Annotated[int, msgspec.Meta(ge=0, lt=INT32)]
# msgspec reads an integer as int64: one outside it fails as out of range.
Int64 = int
Seconds = Annotated[float, msgspec.Meta(ge=-1.7e308, le=1.7e308)]
# A rendezvous round: the worker's number, or the agent's name for it ("<job>.<launch>/<n>").
Round = Int64 | Annotated[str, msgspec.Meta(max_length=128)]

AGENT_KINDS = frozenset(
    {
        EventKind.RANK_FAILURE,
        EventKind.GPU_FAULT,
        EventKind.HANG,
        EventKind.STRAGGLER,
        EventKind.PREFLIGHT_FAILED,
        EventKind.SPARE_REFUSED,
        EventKind.AGENT_STOPPED,
        EventKind.COLLECTIVE_ERROR,
        EventKind.PEER_DEAD,
        EventKind.FENCED,
        EventKind.LAUNCHER_FAILED,
        EventKind.RESTART,
        EventKind.CHECKPOINT,
        EventKind.NUMERICAL_FAULT,
    }
)
DAEMON_ONLY_KINDS = frozenset(EventKind) - AGENT_KINDS
# Keys of an event's details that only the daemon writes (its findings, restarts, goodput, a
# judged allocation report): an agent's event holding one is refused.
DAEMON_KEYS = frozenset(
    {
        "key",
        "restart_key",
        "free",
        "agent_id",
        "goodput",
        "time_lost_counted_on",
        "allocation",
        "ignored",
        "refused",
        "report_event_id",
        "stage",
    }
)


class Details(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Details of a kind whose keys the daemon never reads (all free, bounded)."""

    # Any kind may name a GPU: ingest stores these two as columns (events.xid, gpu_index).
    xid: Index32 | None = None
    gpu_index: Index32 | None = None


class RoundDetails(Details, frozen=True, forbid_unknown_fields=False):
    """A restart or a peer's failure seen by a rank: the round it ended (core.budget)."""

    rdzv_round: Round | None = None


class CheckpointDetails(Details, frozen=True, forbid_unknown_fields=False):
    """A verified checkpoint (``step``) or a complete file the batch step found (``ordinal``
    with its ``layout``): the run's progress (controller.restarts, goodput_pass)."""

    step: Int32 | None = None
    ordinal: Int64 | None = None
    layout: Word | None = None
    label: Label | None = None
    path: Label | None = None


class GpuFaultDetails(Details, frozen=True, forbid_unknown_fields=False):
    """What the daemon classifies a GPU fault from (gpu.xids.classify_fault); the agent's own
    ``action`` is kept for people and never read."""

    fault_kind: Word | None = None
    code: Int64 | Label | None = None
    detail: Text | None = None
    action: Word | None = None


class HangDetails(Details, frozen=True, forbid_unknown_fields=False):
    """The stacks an agent saved before it killed hung workers, by rank."""

    stacks: dict[Word, Text] = msgspec.field(default_factory=dict)
    stack_files: dict[Word, Label] = msgspec.field(default_factory=dict)


class NumericalDetails(RoundDetails, frozen=True, forbid_unknown_fields=False):
    """A rank's non-finite loss: ``action`` is the script's policy (``stop`` ends the run)."""

    action: Word | None = None


class PeerDeadDetails(Details, frozen=True, forbid_unknown_fields=False):
    peer: Annotated[str, msgspec.Meta(max_length=MAX_NODE)] | None = None
    silent_s: Seconds | None = None


SCHEMAS: dict[EventKind, type[Details]] = {
    **{kind: Details for kind in AGENT_KINDS},
    EventKind.RESTART: RoundDetails,
    EventKind.COLLECTIVE_ERROR: RoundDetails,
    EventKind.CHECKPOINT: CheckpointDetails,
    EventKind.GPU_FAULT: GpuFaultDetails,
    EventKind.HANG: HangDetails,
    EventKind.NUMERICAL_FAULT: NumericalDetails,
    EventKind.PEER_DEAD: PeerDeadDetails,
}


def details_problem(kind: EventKind, details: dict[str, Any]) -> str | None:
    """Why an agent may not send an event of ``kind`` with these ``details``; None when it
    may. The message starts with the field it names (as protocol's item refusals do)."""
    if kind in DAEMON_ONLY_KINDS:
        return f"kind: {kind.value!r} is recorded by the daemon only, never sent by an agent"
    reserved = sorted(DAEMON_KEYS.intersection(details))
    if reserved:
        return f"details.{reserved[0]}: a key only the daemon writes"
    try:
        msgspec.convert(details, SCHEMAS[kind], strict=True)
    except msgspec.ValidationError as error:
        what, _, where = str(error).partition(" - at `$")
        field = where.rstrip("`")
        return f"details{field}: {what[:1].lower()}{what[1:]}"
    return None
