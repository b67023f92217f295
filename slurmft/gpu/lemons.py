"""Lemon nodes: when restart-class Xids (13, 31, 43) say "the node", not "the application".

Pure: history in, verdicts out. These Xids are usually the application's own bug, so one run
alone never makes a node a lemon, however often it repeats there. A node is a lemon when such
Xids happened on it in at least ``min_runs`` DIFFERENT runs within ``window``. A run in which
more than ``max_nodes_per_run`` nodes reported them is evidence against the application, not
against any node (NVIDIA's Xid 31 workflow: repeats on the same GPU suggest hardware, on
different GPUs the application), and counts against no node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from slurmft.config import TrustSection
from slurmft.gpu.xids import APPLICATION_XIDS

# The restart-class Xids a node's lemon standing is judged on: the last two weeks'.
LEMON_WINDOW = timedelta(days=14)
# No Xid: a numerical fault that a re-run of the same step on the same data did not reproduce
# (slurmft.train.numerical), a suspected silent corruption on that rank's node. Judged like a
# restart-class Xid: one run alone never makes a lemon.
SUSPECTED_CORRUPTION = 0
LEMON_EVIDENCE = APPLICATION_XIDS | {SUSPECTED_CORRUPTION}


@dataclass(frozen=True)
class XidOccurrence:
    node: str
    run_id: str
    xid: int
    at: datetime


@dataclass(frozen=True)
class LemonVerdict:
    node: str
    is_lemon: bool
    runs: tuple[str, ...]  # the runs that count as evidence against this node, sorted
    xids: tuple[int, ...]
    reason: str


def judge_lemons(
    history: Iterable[XidOccurrence],
    *,
    now: datetime,
    min_runs: int = TrustSection.lemon_min_runs,
    window: timedelta = LEMON_WINDOW,
    max_nodes_per_run: int = 1,
    xids: frozenset[int] = LEMON_EVIDENCE,
) -> dict[str, LemonVerdict]:
    """A verdict for every node with restart-class Xids in the window."""
    if min_runs < 2:
        raise ValueError("min_runs must be at least 2: one run alone never makes a lemon")
    recent = [o for o in history if o.xid in xids and now - window <= o.at <= now]
    nodes_per_run: dict[str, set[str]] = defaultdict(set)
    for o in recent:
        nodes_per_run[o.run_id].add(o.node)
    evidence: dict[str, set[str]] = defaultdict(set)
    seen_xids: dict[str, set[int]] = defaultdict(set)
    for o in recent:
        seen_xids[o.node].add(o.xid)
        if len(nodes_per_run[o.run_id]) <= max_nodes_per_run:
            evidence[o.node].add(o.run_id)
    return {
        node: _verdict(node, evidence[node], seen_xids[node], min_runs, window)
        for node in sorted(seen_xids)
    }


def _verdict(
    node: str, runs: set[str], xids: set[int], min_runs: int, window: timedelta
) -> LemonVerdict:
    ordered, codes = tuple(sorted(runs)), tuple(sorted(xids))
    is_lemon = len(ordered) >= min_runs
    xid_text = _evidence_text(codes)
    if is_lemon:
        reason = (
            f"slurmft: lemon: {xid_text} in {len(ordered)} different runs "
            f"within {window.days} days"
        )
    else:
        reason = f"{xid_text} in {len(ordered)} run(s) attributable to this node; not a lemon"
    return LemonVerdict(node, is_lemon, ordered, codes, reason)


def _evidence_text(codes: tuple[int, ...]) -> str:
    """`Xid 13/31`, and the suspected corruptions in words."""
    xids = [str(code) for code in codes if code != SUSPECTED_CORRUPTION]
    parts = [f"Xid {'/'.join(xids)}"] if xids else []
    if SUSPECTED_CORRUPTION in codes:
        parts.append("numerical faults not reproduced on re-run")
    return " and ".join(parts)
