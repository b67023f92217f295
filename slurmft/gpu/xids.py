"""The one Xid classification table, and the rules for the NVML recovery-action field.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog"
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), column "Resolution
Bucket (Immediate Action)". Our action follows from NVIDIA's bucket:

- RESTART_APP                              -> restart the run, the node stays
- RESET_GPU, RESTART_BM, WORKFLOW_XID_48,
  WORKFLOW_NVLINK_ERR, WORKFLOW_NVLINK5_ERR -> drain the node (a reset, reboot, ECC or NVLink
                                              workflow is needed; a human or repair flow)
- IGNORE, XID_154 (informational)          -> record only

Two deliberate departures, both marked in the table: Xid 43 (NVIDIA: IGNORE, because the GPU
stays healthy) is logged when "a user application hits a software induced fault and must
terminate", so for a run it means a restart; Xid 45 (WORKFLOW_XID_45) is cleanup after another
Xid, so it is recorded and the other Xid decides. An Xid not in the table is recorded and
treated as restart-the-application: never a crash, never a drain on a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurmft.gpu.api import FaultAction, FaultKind

# Xids that are usually the application's own bug (NVIDIA: WORKFLOW_XID_13 / _31; Xid 43 is
# "a user application error"). One run alone never makes a node a lemon: see lemons.py.
APPLICATION_XIDS = frozenset({13, 31, 43})


@dataclass(frozen=True)
class XidRule:
    mnemonic: str
    summary: str  # what the drain reason says: "Xid 79 GPU fell off the bus"
    nvidia_action: str  # NVIDIA's immediate-action bucket, verbatim
    action: FaultAction


_R, _D, _I = FaultAction.RESTART_APP, FaultAction.DRAIN, FaultAction.RECORD

XID_TABLE: dict[int, XidRule] = {
    8: XidRule("ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", "RESTART_APP",
               _R),
    11: XidRule("ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "corrupted push buffer", "RESTART_APP", _R),
    13: XidRule("ROBUST_CHANNEL_GR_EXCEPTION", "graphics engine exception", "RESTART_APP", _R),
    25: XidRule("ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", "illegal push buffer", "RESTART_APP", _R),
    31: XidRule("ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", "RESTART_APP",
                _R),
    32: XidRule("ROBUST_CHANNEL_PBDMA_ERROR", "corrupted push buffer stream", "RESTART_APP", _R),
    # Departure: NVIDIA says IGNORE for the GPU, but the application must terminate.
    43: XidRule("ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "application fault (reset channel)",
                "IGNORE", _R),
    # Departure: WORKFLOW_XID_45 = cleanup after another Xid; that other Xid decides.
    45: XidRule("ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "preemptive cleanup after another error",
                "WORKFLOW_XID_45", _I),
    46: XidRule("ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU timeout", "RESET_GPU", _D),
    48: XidRule("ROBUST_CHANNEL_GPU_ECC_DBE", "double-bit ECC error", "WORKFLOW_XID_48", _D),
    62: XidRule("PMU_HALT_ERROR", "internal micro-controller halt", "RESET_GPU", _D),
    63: XidRule("INFOROM_DRAM_RETIREMENT_EVENT", "row remap or page retirement event", "IGNORE",
                _I),
    64: XidRule("INFOROM_DRAM_RETIREMENT_FAILURE", "row remap or page retirement failure",
                "RESET_GPU", _D),
    74: XidRule("NVLINK_ERROR", "NVLink error", "WORKFLOW_NVLINK_ERR", _D),
    79: XidRule("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU fell off the bus", "RESTART_BM",
                _D),
    92: XidRule("EXCESSIVE_SBE_INTERRUPTS", "high single-bit ECC error rate", "IGNORE", _I),
    94: XidRule("ROBUST_CHANNEL_CONTAINED_ERROR", "contained memory error", "RESTART_APP", _R),
    95: XidRule("ROBUST_CHANNEL_UNCONTAINED_ERROR", "uncontained memory error", "RESET_GPU", _D),
    109: XidRule("ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "context switch timeout", "RESET_GPU", _D),
    110: XidRule("SEC_FAULT_ERROR", "security fault", "RESET_GPU", _D),
    119: XidRule("GSP_RPC_TIMEOUT", "GSP RPC timeout", "RESET_GPU", _D),
    120: XidRule("GSP_ERROR", "GSP error", "RESET_GPU", _D),
    121: XidRule("C2C_ERROR", "corrected C2C link error", "IGNORE", _I),
    136: XidRule("ALI_TRAINING_FAIL", "link training failed", "RESET_GPU", _D),
    137: XidRule("NVLINK_PRIV_ERR", "NVLink privilege error", "IGNORE", _I),
    140: XidRule("UNRECOVERABLE_ECC_ERROR_ESCAPE", "unrecovered ECC error", "RESET_GPU", _D),
    143: XidRule("GPU_INIT_ERROR", "GPU initialization error", "RESET_GPU", _D),
    144: XidRule("NVLINK_SAW_ERROR", "NVLink SAW error", "WORKFLOW_NVLINK5_ERR", _D),
    145: XidRule("NVLINK_RLW_ERROR", "NVLink RLW error", "WORKFLOW_NVLINK5_ERR", _D),
    146: XidRule("NVLINK_TLW_ERROR", "NVLink TLW error", "WORKFLOW_NVLINK5_ERR", _D),
    147: XidRule("NVLINK_TREX_ERROR", "NVLink TREX error", "WORKFLOW_NVLINK5_ERR", _D),
    148: XidRule("NVLINK_NVLPW_CTRL_ERROR", "NVLink NVLPW_CTRL error", "WORKFLOW_NVLINK5_ERR", _D),
    149: XidRule("NVLINK_NETIR_ERROR", "NVLink NETIR error", "WORKFLOW_NVLINK5_ERR", _D),
    150: XidRule("NVLINK_MSE_ERROR", "NVLink MSE error", "WORKFLOW_NVLINK5_ERR", _D),
    # Informational: "summarizes the recovery action required for other Xids"; the line's
    # target action decides (see classify_xid).
    154: XidRule("GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed", "XID_154", _I),
    155: XidRule("NVLINK_SW_DEFINED_ERROR", "NVLink software-defined error", "RESET_GPU", _D),
    156: XidRule("RESOURCE_RETIREMENT_EVENT", "resource retirement event", "RESET_GPU", _D),
    157: XidRule("RESOURCE_RETIREMENT_FAILURE", "resource retirement failure", "IGNORE", _I),
    158: XidRule("GPU_FATAL_TIMEOUT", "GPU fatal timeout", "RESET_GPU", _D),
}


@dataclass(frozen=True)
class XidVerdict:
    xid: int
    action: FaultAction
    summary: str
    known: bool
    fault_class: str  # a slurmft.db.models.FaultClass value


NVLINK5_XIDS = frozenset(range(144, 151))
_NONFATAL = re.compile(r"\bNonfatal\b")
# "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
_XID154_TARGET = re.compile(r"\bto\s+(0x[0-9a-fA-F]+)\s*(?:\(([^)]*)\))?")


def classify_xid(xid: int, message: str = "") -> XidVerdict:
    """Look an Xid up in the table; unknown ones restart the app and say so."""
    rule = XID_TABLE.get(xid)
    if rule is None:
        return XidVerdict(xid, FaultAction.RESTART_APP, "unknown Xid", False, "unknown")
    action, summary = rule.action, rule.summary
    if xid == 154:
        action, summary = _xid154(message, summary)
    elif xid in NVLINK5_XIDS and _NONFATAL.search(message):
        # The catalog's subcode table marks the "Nonfatal" 144-150 subcodes IGNORE; the driver
        # prints the word: "144, SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 ...)".
        action, summary = FaultAction.RECORD, f"{summary} (non-fatal)"
    return XidVerdict(xid, action, summary, True, _fault_class(xid, action))


def _xid154(message: str, summary: str) -> tuple[FaultAction, str]:
    match = _XID154_TARGET.search(message)
    if match is None:
        return FaultAction.RECORD, summary
    code, name = int(match.group(1), 16), (match.group(2) or "").strip()
    if code == 0:
        return FaultAction.RECORD, "GPU recovery action cleared"
    return FaultAction.DRAIN, f"GPU recovery action: {name or hex(code)}"


def _fault_class(xid: int, action: FaultAction) -> str:
    if xid in APPLICATION_XIDS:
        return "user_code"
    return "hardware"


# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvmlDeviceGpuRecoveryAction_t, pynvml 13.x).
# Anything but NONE means the driver wants the GPU reset, drained or the node rebooted.
RECOVERY_ACTIONS: dict[int, str] = {
    0: "None",
    1: "GPU Reset",
    2: "Node Reboot",
    3: "Drain P2P",
    4: "Drain and Reset",
    5: "Recover IMEX Domain",
    6: "Bus Reset",
    7: "System Reboot",
}


def classify_recovery_action(value: int) -> tuple[FaultAction, str]:
    name = RECOVERY_ACTIONS.get(value, f"unknown action {value}")
    if value == 0:
        return FaultAction.RECORD, "GPU recovery action None"
    return FaultAction.DRAIN, f"GPU recovery action {name}"


# The conditions NVML reads (and injection mimics): the kind alone says what it asks for.
CONDITION_ACTIONS: dict[FaultKind, FaultAction] = {
    FaultKind.ECC_UNCORRECTED: FaultAction.DRAIN,
    FaultKind.REMAP_PENDING: FaultAction.DRAIN,
    FaultKind.REMAP_FAILURE: FaultAction.DRAIN,
    FaultKind.RETIRED_PAGES_PENDING: FaultAction.DRAIN,
    FaultKind.GPU_LOST: FaultAction.DRAIN,
    FaultKind.GPU_UNREACHABLE: FaultAction.RECORD,
    FaultKind.CLOCK_SLOWDOWN: FaultAction.RECORD,
}
# `dcgmi health`: a Failure drains (DCGM saw the GPU fail a watched system), a Warning is
# recorded; Healthy is no fault.
DCGM_HEALTH_ACTIONS: dict[str, FaultAction] = {
    "Failure": FaultAction.DRAIN,
    "Warning": FaultAction.RECORD,
}
# What a fault this table cannot classify calls for: restart the application, never a drain
# on a guess (as for an unknown Xid).
UNKNOWN_FAULT_ACTION = FaultAction.RESTART_APP


def classify_fault(
    kind: str | None, *, xid: int | None = None, code: object = None, message: str = ""
) -> FaultAction:
    """The action a reported fault calls for, from its kind and code alone: the daemon's own
    reading of an agent's report (the agent's stated action is never taken). An Xid goes
    through XID_TABLE (``message``: the driver's line, which Xid 154 and the NVLink5 Xids
    read), the NVML recovery action through RECOVERY_ACTIONS, DCGM's health string through
    DCGM_HEALTH_ACTIONS; anything unknown is UNKNOWN_FAULT_ACTION."""
    if kind in (None, "", FaultKind.XID) and xid is not None:
        return classify_xid(xid, message).action
    if kind == FaultKind.RECOVERY_ACTION:
        if isinstance(code, int) and not isinstance(code, bool):
            return classify_recovery_action(code)[0]
        return UNKNOWN_FAULT_ACTION
    if kind == FaultKind.DCGM_HEALTH:
        return DCGM_HEALTH_ACTIONS.get(code, UNKNOWN_FAULT_ACTION) if isinstance(code, str) else (
            UNKNOWN_FAULT_ACTION
        )
    try:
        return CONDITION_ACTIONS.get(FaultKind(str(kind)), UNKNOWN_FAULT_ACTION)
    except ValueError:
        return UNKNOWN_FAULT_ACTION


def xid_table_markdown() -> str:
    """The table as Markdown (docs/gpu.md carries it; a test keeps the two equal)."""
    lines = [
        "| Xid | NVIDIA mnemonic | drain reason / summary | NVIDIA immediate action | slurmft |",
        "|---:|---|---|---|---|",
    ]
    for xid, rule in sorted(XID_TABLE.items()):
        lines.append(f"| {xid} | `{rule.mnemonic}` | {rule.summary} | {rule.nvidia_action} | "
                     f"{rule.action} |")
    return "\n".join(lines) + "\n"
