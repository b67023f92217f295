"""Parsers for `squeue --json` and node `--json` documents, old and new shapes.

slurmft reads the text formats by default (22.05's --json ignores -j/-t/-n filters, measured); these
parsers are for Slurm 23.02+ where --json honours filters, and they accept both shapes:
- openapi v0.0.38 (22.05, recorded here): `"job_state": "RUNNING"`, plain integers,
  nodes with `"state": "idle"` and `"state_flags": ["DRAIN"]`;
- v0.0.40 and later (23.11+): `"job_state": ["PENDING", "REQUEUED"]`, integers wrapped as
  `{"set": true, "infinite": false, "number": 3}`, nodes with `"state": ["IDLE", "DRAIN"]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slurmft.slurm.api import JobInfo, NodeInfo
from slurmft.slurm.hostlist import expand
from slurmft.slurm.parse import blank
from slurmft.slurm.states import parse_job_state, parse_node_state


def number(value: Any) -> int | None:
    """A plain integer, or v0.0.40's `{"set": .., "infinite": .., "number": ..}` (None if unset)."""
    if isinstance(value, Mapping):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    return int(value)


def jobs_from_squeue_json(document: Mapping[str, Any]) -> dict[str, JobInfo]:
    jobs: dict[str, JobInfo] = {}
    for job in document.get("jobs", []):
        job_id = str(number(job.get("job_id")))
        state = job.get("job_state", "")
        jobs[job_id] = JobInfo(
            job_id=job_id,
            state=parse_job_state(state),
            reason=blank(str(job.get("state_reason", ""))),
            nodes=tuple(expand(blank(str(job.get("nodes", ""))))),
            batch_host=blank(str(job.get("batch_host", ""))),
            name=str(job.get("name", "")),
            comment=blank(str(job.get("comment", ""))),
            restarts=number(job.get("restart_cnt")) or 0,
            excluded_nodes=tuple(expand(blank(str(job.get("excluded_nodes", ""))))),
            requeue=job.get("requeue") if isinstance(job.get("requeue"), bool) else None,
            user_id=number(job.get("user_id")),
            raw={key: str(value) for key, value in job.items() if isinstance(value, str | int)},
        )
    return jobs


def nodes_from_json(document: Mapping[str, Any]) -> dict[str, NodeInfo]:
    nodes: dict[str, NodeInfo] = {}
    for node in document.get("nodes", []):
        state = node.get("state", "")
        words = [state] if isinstance(state, str) else list(state)
        words += list(node.get("state_flags", []))  # v0.0.38 keeps flags apart
        nodes[node["name"]] = NodeInfo(
            name=node["name"],
            status=parse_node_state(words),
            reason=str(node.get("reason") or ""),
            reason_user=str(node.get("reason_set_by_user") or ""),  # null in 21.08
            reason_time=str(number(node.get("reason_changed_at")) or ""),
            raw={key: str(value) for key, value in node.items() if isinstance(value, str | int)},
        )
    return nodes
