"""The classification table (every Xid in notes/gpu-faults.md, and an unknown one) and the
lemon judgement, both as tables."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from slurmft.db.models import FaultClass
from slurmft.gpu.api import FaultAction, FaultKind, GpuFault
from slurmft.gpu.lemons import XidOccurrence, judge_lemons
from slurmft.gpu.xids import (
    XID_TABLE,
    classify_recovery_action,
    classify_xid,
    xid_table_markdown,
)

R, D, REC = FaultAction.RESTART_APP, FaultAction.DRAIN, FaultAction.RECORD

# Xid -> (NVIDIA immediate action as in the notes / the catalog, our action)
NOTES_TABLE = {
    8: ("RESTART_APP", R),
    13: ("RESTART_APP", R),
    31: ("RESTART_APP", R),
    43: ("IGNORE", R),  # departure, see xids.py: the application must terminate
    45: ("WORKFLOW_XID_45", REC),  # cleanup after another Xid: that Xid decides
    46: ("RESET_GPU", D),
    48: ("WORKFLOW_XID_48", D),
    62: ("RESET_GPU", D),
    63: ("IGNORE", REC),
    64: ("RESET_GPU", D),
    74: ("WORKFLOW_NVLINK_ERR", D),
    79: ("RESTART_BM", D),
    92: ("IGNORE", REC),
    94: ("RESTART_APP", R),
    95: ("RESET_GPU", D),
    109: ("RESET_GPU", D),
    110: ("RESET_GPU", D),
    119: ("RESET_GPU", D),
    120: ("RESET_GPU", D),
    121: ("IGNORE", REC),
    136: ("RESET_GPU", D),
    140: ("RESET_GPU", D),
    143: ("RESET_GPU", D),
    154: ("XID_154", REC),  # without a target action in the message
    155: ("RESET_GPU", D),
    156: ("RESET_GPU", D),
    158: ("RESET_GPU", D),
}


@pytest.mark.parametrize(("xid", "expected"), sorted(NOTES_TABLE.items()))
def test_every_xid_in_the_notes(xid: int, expected: tuple[str, FaultAction]) -> None:
    nvidia_action, action = expected
    verdict = classify_xid(xid)
    assert verdict.known
    assert XID_TABLE[xid].nvidia_action == nvidia_action
    assert verdict.action is action
    FaultClass(verdict.fault_class)  # a value the store accepts


def test_unknown_xid_is_recorded_and_restarts_the_app_never_crashes() -> None:
    for xid in (999, 0, 4242):  # 999: what NVML reports for an unknown Xid
        verdict = classify_xid(xid, "whatever the driver says")
        assert (verdict.known, verdict.action, verdict.fault_class) == (False, R, "unknown")
        assert verdict.summary == "unknown Xid"


def test_application_xids_are_user_code_and_hardware_ones_hardware() -> None:
    assert {classify_xid(x).fault_class for x in (13, 31, 43)} == {"user_code"}
    assert classify_xid(79).fault_class == "hardware"


@pytest.mark.parametrize(("message", "action", "summary"), [
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", D,
     "GPU recovery action: Node Reboot Required"),
    ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", D,
     "GPU recovery action: GPU Reset Required"),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", REC,
     "GPU recovery action cleared"),
    ("garbled", REC, "GPU recovery action changed"),
])
def test_xid_154_follows_the_target_action(message: str, action: FaultAction,
                                           summary: str) -> None:
    verdict = classify_xid(154, message)
    assert (verdict.action, verdict.summary) == (action, summary)


def test_nvlink5_nonfatal_subcodes_are_recorded_fatal_ones_drain() -> None:
    # leptonai/gpud PR #1160; NVIDIA catalog subcode table (Nonfatal -> IGNORE)
    nonfatal = "SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000)"
    fatal = "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x00000000)"
    assert classify_xid(144, nonfatal).action is REC
    assert classify_xid(149, fatal).action is D


@pytest.mark.parametrize(("value", "action"), [
    (0, REC), (1, D), (2, D), (3, D), (4, D), (5, D), (6, D), (7, D), (99, D),
])
def test_recovery_action_field(value: int, action: FaultAction) -> None:
    assert classify_recovery_action(value)[0] is action


def test_drain_reason_format() -> None:
    fault = GpuFault(FaultKind.XID, D, "GPU fell off the bus", "nvml", gpu=3, xid=79)
    assert fault.drain_reason() == "slurmft: Xid 79 GPU fell off the bus (GPU 3)"
    ecc = GpuFault(FaultKind.ECC_UNCORRECTED, D, "uncorrected ECC errors: 2", "nvml", gpu=1)
    assert ecc.drain_reason() == "slurmft: uncorrected ECC errors: 2 (GPU 1)"
    lost = GpuFault(FaultKind.GPU_LOST, D, "GPU is lost", "nvml")
    assert lost.drain_reason() == "slurmft: GPU is lost"


# --- lemons ---------------------------------------------------------------------------------

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _at(hours_ago: float) -> datetime:
    return NOW - timedelta(hours=hours_ago)


def occ(node: str, run: str, xid: int = 13, hours_ago: float = 1) -> XidOccurrence:
    return XidOccurrence(node, run, xid, _at(hours_ago))


LEMON_CASES = [
    # (name, history, {node: is_lemon})
    ("one run alone, however often, never makes a lemon",
     [occ("n1", "r1")] * 50, {"n1": False}),
    ("the same node in two different runs is a lemon",
     [occ("n1", "r1"), occ("n1", "r2", xid=31)], {"n1": True}),
    ("Xid 43 counts like 13 and 31",
     [occ("n1", "r1", xid=43), occ("n1", "r2", xid=43)], {"n1": True}),
    ("drain-class and record-class Xids are not lemon evidence",
     [occ("n1", "r1", xid=79), occ("n1", "r2", xid=63)], {}),
    ("a run where many nodes saw the Xid blames the application, not the nodes",
     [occ("n1", "r1"), occ("n2", "r1"), occ("n3", "r1"), occ("n1", "r2"), occ("n2", "r2")],
     {"n1": False, "n2": False, "n3": False}),
    ("a node alone in two runs while others were clean is a lemon",
     [occ("n1", "r1"), occ("n1", "r2"), occ("n2", "r3")], {"n1": True, "n2": False}),
    ("evidence older than the window has expired",
     [occ("n1", "r1", hours_ago=24 * 30), occ("n1", "r2")], {"n1": False}),
    ("future-dated evidence is ignored",
     [occ("n1", "r1", hours_ago=-5), occ("n1", "r2")], {"n1": False}),
]


@pytest.mark.parametrize(("name", "history", "expected"), LEMON_CASES,
                         ids=[case[0] for case in LEMON_CASES])
def test_lemon_table(name: str, history: list[XidOccurrence], expected: dict[str, bool]) -> None:
    verdicts = judge_lemons(history, now=NOW)
    assert {node: v.is_lemon for node, v in verdicts.items()} == expected


def test_lemon_verdict_says_why_and_respects_min_runs() -> None:
    history = [occ("n1", "r1"), occ("n1", "r2"), occ("n1", "r3", xid=31)]
    verdict = judge_lemons(history, now=NOW)["n1"]
    assert verdict.runs == ("r1", "r2", "r3") and verdict.xids == (13, 31)
    assert verdict.reason == "slurmft: lemon: Xid 13/31 in 3 different runs within 14 days"
    assert not judge_lemons(history, now=NOW, min_runs=4)["n1"].is_lemon
    with pytest.raises(ValueError, match="one run alone"):
        judge_lemons(history, now=NOW, min_runs=1)


def test_docs_carry_the_table_as_generated() -> None:
    docs = Path(__file__).resolve().parents[3] / "docs" / "gpu.md"
    assert xid_table_markdown() in docs.read_text(), "regenerate the table in docs/gpu.md"
