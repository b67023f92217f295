"""`slurmft nodes` and `slurmft nodes release NODE`, answered by the daemon over its socket.

Every node slurmft knows (in Slurm, on the denylist, or named by a failure): its Slurm state and
drain (reason, by whom, when), its denylist entries (why, which run, when), its failures and its
lemon standing. Any user may list them (sinfo shows every user the same drains); the run an
entry names is shown to its owner and to admins only.

Release is for admins (slurmft.controller.admins): it ends the node's denylist entries and
resumes it in Slurm only if slurmft drained it or set it DOWN (a drain or DOWN slurmft recorded,
and Slurm's reason still slurmft's), never someone else's. Each step is an action row with the
reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from slurmft.controller.admins import Admins
from slurmft.controller.observe import OWN_DRAIN_PREFIX, xid_history
from slurmft.controller.rpc import Operation, RpcError
from slurmft.db import Database
from slurmft.db.history import read_view
from slurmft.db.models import Action, ActionKind, ActionStatus, DenylistEntry, Run, utcnow
from slurmft.db.records import active_denylist, denylist_release, finish_action, plan_action
from slurmft.gpu.lemons import judge_lemons
from slurmft.slurm.api import NodeInfo, SlurmClient, SlurmError
from slurmft.slurm.names import InvalidNodeName, check_node_name


@dataclass(frozen=True)
class NodeOps:
    database: Database
    slurm: SlurmClient
    admins: Admins
    lemon_min_runs: int
    user_name: Callable[[int], str]  # for the action rows

    def nodes(self, uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        try:
            slurm: dict[str, NodeInfo] | None = self.slurm.nodes()
            slurm_error = None
        except SlurmError as error:
            slurm, slurm_error = None, str(error)
        now = utcnow()
        with self.database.session() as session:
            entries = active_denylist(session, now=now)
            owners = _owners(session, {e.run_id for e in entries if e.run_id})
            failures = _failures(session)
            verdicts = judge_lemons(
                xid_history(session, now=now), now=now, min_runs=self.lemon_min_runs
            )
            drained_by_us = _taken_out_by_slurmft(session)
        names = sorted(set(slurm or {}) | {e.node for e in entries} | set(failures))
        rows = []
        for name in names:
            info = (slurm or {}).get(name)
            verdict = verdicts.get(name)
            rows.append(
                {
                    "node": name,
                    "state": _state(info) if info else None,
                    "drain": _drain(info, name in drained_by_us) if info else None,
                    "denylist": [
                        _entry(e, uid == owners.get(e.run_id or "") or uid in self.admins)
                        for e in entries
                        if e.node == name
                    ],
                    "failures": failures.get(name, _NO_FAILURES),
                    "lemon": {
                        "is_lemon": bool(verdict and verdict.is_lemon),
                        "reason": verdict.reason if verdict else "",
                    },
                }
            )
        return {"nodes": rows, "slurm_error": slurm_error}

    def release(self, uid: int, args: Mapping[str, Any]) -> dict[str, Any]:
        if uid not in self.admins:
            raise RpcError("only an admin (root, or daemon.admin_group) may release a node")
        try:
            node = check_node_name(args.get("node"))
        except InvalidNodeName as error:
            raise RpcError(str(error)) from None
        who = self.user_name(uid)
        with self.database.session() as session:
            removed = denylist_release(session, node)
            reason = f"released by {who}: {removed} denylist entries ended"
            finish_action(
                plan_action(session, ActionKind.DENYLIST_REMOVE, reason, node=node),
                ActionStatus.DONE,
            )
            ours = node in _taken_out_by_slurmft(session)
        resumed, why = self._resume_if_ours(node, ours, who)
        return {"node": node, "denylist_entries_ended": removed, "resumed": resumed, "why": why}

    def _resume_if_ours(self, node: str, ours: bool, who: str) -> tuple[bool, str]:
        try:
            info = self.slurm.node(node)
        except SlurmError as error:
            return self._record_resume(node, False, f"Slurm did not answer: {error}", who)
        if not (info.status.drain_requested or info.status.down):
            return False, "neither drained nor DOWN in Slurm"
        if not (ours and info.reason.startswith(OWN_DRAIN_PREFIX)):
            return False, f"taken out by someone else ({info.reason!r}): left as it is"
        try:
            self.slurm.resume(node)
        except SlurmError as error:
            return self._record_resume(node, False, f"scontrol refused: {error}", who)
        return self._record_resume(node, True, "resumed", who)

    def _record_resume(self, node: str, done: bool, why: str, who: str) -> tuple[bool, str]:
        with self.database.session() as session:
            row = plan_action(
                session, ActionKind.RESUME_NODE, f"released by {who}: {why}", node=node
            )
            finish_action(row, ActionStatus.DONE if done else ActionStatus.FAILED,
                          error=None if done else why)  # fmt: skip
        return done, why

    def operations(self) -> dict[str, Operation]:
        return {"nodes": self.nodes, "release_node": self.release}


_NO_FAILURES: dict[str, Any] = {"failures": 0, "hardware_failures": 0, "runs": 0, "last_at": None}


def _owners(session: Session, run_ids: set[str]) -> dict[str, int]:
    if not run_ids:
        return {}
    rows = session.execute(select(Run.id, Run.owner_uid).where(Run.id.in_(run_ids))).all()
    return {run_id: owner for run_id, owner in rows}


def _failures(session: Session) -> dict[str, dict[str, Any]]:
    """From the `node_lemons` view (docs/failure-history.md): the run's own evidence only."""
    return {
        row["node"]: {
            "position": row["position"],
            "failures": row["failures"],
            "hardware_failures": row["hardware_failures"],
            "runs": row["runs"],
            "last_at": row["last_failure_at"],
        }
        for row in read_view(session, "node_lemons")
    }


_TAKEN_OUT = (ActionKind.DRAIN_NODE, ActionKind.EVICT_NODE)  # a drain, a DOWN


def _taken_out_by_slurmft(session: Session) -> set[str]:
    """Nodes whose latest drain, DOWN or resume by slurmft is a drain or a DOWN that was
    carried out."""
    latest: dict[str, ActionKind] = {}
    rows = session.execute(
        select(Action.node, Action.kind)
        .where(
            Action.kind.in_([*_TAKEN_OUT, ActionKind.RESUME_NODE]),
            Action.status == ActionStatus.DONE,
            Action.node.is_not(None),
        )
        .order_by(Action.id)
    ).all()
    for node, kind in rows:
        if node is not None:
            latest[node] = kind
    return {node for node, kind in latest.items() if kind in _TAKEN_OUT}


def _state(info: NodeInfo) -> str:
    status = info.status
    words = [status.base.value.lower(), *sorted(f.value.lower() for f in status.flags)]
    return "+".join(words)


def _drain(info: NodeInfo, by_slurmft: bool) -> dict[str, Any] | None:
    if not info.status.drain_requested:
        return None
    return {
        "reason": info.reason,
        "by": info.reason_user,
        "at": info.reason_time,
        "by_slurmft": by_slurmft and info.reason.startswith(OWN_DRAIN_PREFIX),
    }


def _entry(entry: DenylistEntry, may_see_run: bool) -> dict[str, Any]:
    return {
        "reason": entry.reason,
        "run_id": (entry.run_id if may_see_run else "another user's run") if entry.run_id else None,
        "scope": "run" if entry.run_id else "all runs",
        "added_at": entry.added_at.isoformat(),
        "expires_at": entry.expires_at.isoformat() if entry.expires_at else None,
    }
