"""The daemon classifies an agent's GPU fault itself, from its kind and code through the one
table: the action the agent states is never taken (slurmft.controller.observe.fault_action)."""

from __future__ import annotations

import json

import pytest

from slurmft.controller.observe import fault_action
from slurmft.gpu.api import FaultAction, FaultKind
from slurmft.gpu.dcgm import parse_dcgmi_health
from slurmft.gpu.inject import fault_from_spec
from slurmft.gpu.xids import XID_TABLE, classify_fault, classify_xid

R, D, REC = FaultAction.RESTART_APP, FaultAction.DRAIN, FaultAction.RECORD


@pytest.mark.parametrize(
    ("details", "xid", "action"),
    [
        ({"fault_kind": "xid", "action": "drain"}, 13, R),  # restart-class Xid said "drain"
        ({"fault_kind": "xid", "action": "drain"}, 63, REC),  # record-class
        ({"action": "drain"}, 43, R),  # an older agent: no kind, the Xid decides
        ({"fault_kind": "xid", "action": "record"}, 79, D),  # understated: drained anyway
        ({"fault_kind": "recovery_action", "code": 2, "action": "record"}, None, D),
        ({"fault_kind": "recovery_action", "code": "2", "action": "drain"}, None, R),
        ({"fault_kind": "dcgm_health", "code": "Warning", "action": "drain"}, None, REC),
        ({"fault_kind": "gpu_unreachable", "action": "drain"}, None, REC),
        ({"fault_kind": "made-up", "action": "drain"}, None, R),  # unknown: the table's default
        ({"action": "drain"}, None, R),
        (
            {
                "fault_kind": "xid",
                "detail": "Xid (PCI:0000:3b:00): 154, GPU recovery action "
                "changed from 0x0 (None) to 0x2 (Node Reboot Required)",
            },
            154,
            D,
        ),
    ],
)
def test_the_posters_action_is_never_read(
    details: dict[str, object], xid: int | None, action: FaultAction
) -> None:
    assert fault_action(details, xid) is action


def test_every_source_fault_reads_back_as_its_own_action() -> None:
    """What a source decided on the node is what the daemon decides from the kind and code the
    agent sends: one table, no drift."""
    specs = [
        *({"xid": x} for x in XID_TABLE),
        {"xid": 9999},
        {"xid": 145, "message": "145, RLW_MVB Nonfatal XC0 i0 Link 0"},
        {"kind": "ecc_uncorrected", "count": 2},
        {"kind": "remap_pending"},
        {"kind": "remap_failure"},
        {"kind": "retired_pages_pending"},
        {"kind": "gpu_lost"},
        {"kind": "clock_slowdown"},
        *({"kind": "recovery_action", "value": v} for v in range(9)),
    ]
    faults = [fault_from_spec(spec, f"line:{n}") for n, spec in enumerate(specs)]
    health = {"Memory system": {"value": "Failure"}, "PCIe": {"value": "Warning"}}
    dcgm = {"body": {"GPU": {"children": {"0": {"children": {"Errors": {"children": health}}}}}}}
    faults += parse_dcgmi_health(json.dumps(dcgm))
    for fault in faults:
        kind, code = fault.kind.value, fault.code
        read = classify_fault(kind, xid=fault.xid, code=code, message=fault.detail)
        assert read is fault.action, fault
    assert classify_fault(FaultKind.XID.value, xid=79) is classify_xid(79).action
