from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurmft.slurm.states import (
    JobPhase,
    JobState,
    NodeBase,
    NodeFlag,
    NodeStatus,
    parse_job_state,
    parse_node_state,
)

# The job state codes of `man squeue` (22.05), long and short.
SQUEUE_MAN_CODES = {
    "BF": "BOOT_FAIL", "CA": "CANCELLED", "CD": "COMPLETED", "CF": "CONFIGURING",
    "CG": "COMPLETING", "DL": "DEADLINE", "F": "FAILED", "NF": "NODE_FAIL",
    "OOM": "OUT_OF_MEMORY", "PD": "PENDING", "PR": "PREEMPTED", "R": "RUNNING",
    "RD": "RESV_DEL_HOLD", "RF": "REQUEUE_FED", "RH": "REQUEUE_HOLD", "RQ": "REQUEUED",
    "RS": "RESIZING", "RV": "REVOKED", "SI": "SIGNALING", "SE": "SPECIAL_EXIT",
    "SO": "STAGE_OUT", "ST": "STOPPED", "S": "SUSPENDED", "TO": "TIMEOUT",
}  # fmt: skip


@pytest.mark.parametrize(("code", "name"), sorted(SQUEUE_MAN_CODES.items()))
def test_every_squeue_state_code_is_in_the_table(code: str, name: str) -> None:
    assert parse_job_state(name) is JobState(name)
    assert parse_job_state(code) is JobState(name)
    assert JobState(name).short_code == code
    assert JobState(name).phase is not JobPhase.UNKNOWN


@pytest.mark.parametrize(
    ("text", "state", "phase"),
    [
        ("RUNNING", JobState.RUNNING, JobPhase.ACTIVE),
        ("CANCELLED by 0", JobState.CANCELLED, JobPhase.ENDED),  # sacct's spelling
        ("completing", JobState.COMPLETING, JobPhase.ACTIVE),
        ("REQUEUED", JobState.REQUEUED, JobPhase.WAITING),
        ("NODE_FAIL", JobState.NODE_FAIL, JobPhase.ENDED),
        ("SOMETHING_NEW", JobState.UNKNOWN, JobPhase.UNKNOWN),
        ("", JobState.UNKNOWN, JobPhase.UNKNOWN),
    ],
)
def test_job_state_spellings(text: str, state: JobState, phase: JobPhase) -> None:
    assert parse_job_state(text) is state
    assert state.phase is phase


@pytest.mark.parametrize(
    ("words", "state"),
    [
        (["RUNNING"], JobState.RUNNING),
        (["PENDING", "REQUEUED"], JobState.REQUEUED),  # newer --json: base state plus flags
        (["RUNNING", "COMPLETING"], JobState.COMPLETING),
        (["COMPLETED", "NEW_FLAG"], JobState.COMPLETED),
        ([], JobState.UNKNOWN),
    ],
)
def test_job_state_lists_from_newer_json(words: list[str], state: JobState) -> None:
    assert parse_job_state(words) is state


def test_meaning_of_job_states() -> None:
    assert JobState.NODE_FAIL.lost_a_node and JobState.BOOT_FAIL.lost_a_node
    assert not JobState.FAILED.lost_a_node
    assert JobState.COMPLETING.holds_nodes and not JobState.COMPLETING.is_ended
    assert not JobState.REQUEUED.is_ended and not JobState.REQUEUED.holds_nodes
    assert not JobState.UNKNOWN.is_ended and not JobState.UNKNOWN.holds_nodes


D, NR, C = NodeFlag.DRAIN, NodeFlag.NOT_RESPONDING, NodeFlag.COMPLETING


@pytest.mark.parametrize(
    ("text", "base", "flags"),
    [
        # sinfo %T words with suffix characters
        ("idle", NodeBase.IDLE, set()),
        ("down*", NodeBase.DOWN, {NR}),
        ("mixed*", NodeBase.MIXED, {NR}),
        ("drained", NodeBase.IDLE, {D}),
        ("drained*", NodeBase.IDLE, {D, NR}),
        ("draining", NodeBase.ALLOCATED, {D}),
        ("allocated+", NodeBase.ALLOCATED, {C}),
        ("completing", NodeBase.IDLE, {C}),
        ("idle~", NodeBase.IDLE, {NodeFlag.POWERED_DOWN}),
        ("idle#", NodeBase.IDLE, {NodeFlag.POWERING_UP}),
        ("idle!", NodeBase.IDLE, {NodeFlag.POWER_DOWN}),
        ("idle%", NodeBase.IDLE, {NodeFlag.POWERING_DOWN}),
        ("idle$", NodeBase.IDLE, {NodeFlag.MAINTENANCE}),
        ("mixed@", NodeBase.MIXED, {NodeFlag.REBOOT_REQUESTED}),
        ("idle^", NodeBase.IDLE, {NodeFlag.REBOOT_ISSUED}),
        ("mixed-", NodeBase.MIXED, {NodeFlag.PLANNED}),
        ("down*$", NodeBase.DOWN, {NR, NodeFlag.MAINTENANCE}),
        # sinfo %t short forms
        ("drain", NodeBase.IDLE, {D}),
        ("drng", NodeBase.ALLOCATED, {D}),
        ("alloc", NodeBase.ALLOCATED, set()),
        ("mix", NodeBase.MIXED, set()),
        # scontrol compounds (recorded: IDLE+DRAIN, MIXED+DRAIN, DOWN+NOT_RESPONDING)
        ("IDLE+DRAIN", NodeBase.IDLE, {D}),
        ("MIXED+DRAIN", NodeBase.MIXED, {D}),
        ("DOWN+NOT_RESPONDING", NodeBase.DOWN, {NR}),
        ("DOWN+DRAIN+NOT_RESPONDING", NodeBase.DOWN, {D, NR}),
        ("IDLE+CLOUD+POWERED_DOWN", NodeBase.IDLE, {NodeFlag.CLOUD, NodeFlag.POWERED_DOWN}),
        ("ALLOCATED+COMPLETING", NodeBase.ALLOCATED, {C}),
        ("DOWN*", NodeBase.DOWN, {NR}),  # older scontrol
    ],
)
def test_node_state_spellings(text: str, base: NodeBase, flags: set[NodeFlag]) -> None:
    status = parse_node_state(text)
    assert (status.base, status.flags) == (base, frozenset(flags))
    assert not status.unknown_words


def test_node_state_lists_from_json() -> None:
    assert parse_node_state(["IDLE", "DRAIN"]) == NodeStatus(NodeBase.IDLE, frozenset({D}))
    assert parse_node_state(["down", "NOT_RESPONDING"]).lost


def test_unknown_node_words_are_kept_not_dropped() -> None:
    status = parse_node_state("IDLE+SHINY_NEW_FLAG")
    assert status.base is NodeBase.IDLE
    assert status.unknown_words == {"SHINY_NEW_FLAG"}


@pytest.mark.parametrize(
    ("text", "expected"),
    # (drained, draining, lost, down, schedulable)
    [
        ("idle", (False, False, False, False, True)),
        ("mixed", (False, False, False, False, True)),
        ("allocated", (False, False, False, False, False)),
        ("drained", (True, False, False, False, False)),
        ("draining", (False, True, False, False, False)),
        ("mixed*", (False, False, True, False, False)),  # dead batch host, as sinfo shows it
        ("down*", (False, False, True, True, False)),
        ("DOWN+DRAIN+NOT_RESPONDING", (True, False, True, True, False)),
        ("idle~", (False, False, False, False, False)),
    ],
)
def test_what_node_states_mean(text: str, expected: tuple[bool, ...]) -> None:
    status = parse_node_state(text)
    meaning = (status.drained, status.draining, status.lost, status.down, status.schedulable)
    assert meaning == expected


@given(st.sampled_from(list(NodeBase)), st.sets(st.sampled_from(list(NodeFlag))))
def test_node_status_text_round_trips(base: NodeBase, flags: set[NodeFlag]) -> None:
    status = NodeStatus(base, frozenset(flags))
    assert parse_node_state(str(status)) == status
