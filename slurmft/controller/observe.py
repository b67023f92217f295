"""From what Slurm and the store say to the views ``decide`` takes. The mapping is pure; only
``gather`` does I/O (one batched Slurm query for all jobs, one for all their nodes)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from slurmft.agent.exits import BatchExit
from slurmft.controller.detect import RankCompute
from slurmft.controller.views import JobEnd, JobPhase, JobView, NodeCondition
from slurmft.slurm.api import JobInfo, NodeInfo
from slurmft.slurm.states import JobPhase as SlurmPhase
from slurmft.slurm.states import JobState

# Drains whose reason starts with this are slurmft's own; any other drain is someone else's.
OWN_DRAIN_PREFIX = "slurmft:"

_END_BY_STATE = {
    JobState.TIMEOUT: JobEnd.TIME_LIMIT,
    JobState.DEADLINE: JobEnd.TIME_LIMIT,
    JobState.PREEMPTED: JobEnd.PREEMPTED,
    JobState.CANCELLED: JobEnd.CANCELLED,
    JobState.NODE_FAIL: JobEnd.NODE_FAIL,
    JobState.BOOT_FAIL: JobEnd.NODE_FAIL,
}
_END_BY_EXIT = {
    BatchExit.FINISHED: JobEnd.FINISHED,
    BatchExit.GAVE_UP: JobEnd.GAVE_UP,
}


def node_condition(info: NodeInfo | None) -> NodeCondition:
    """A node Slurm no longer reports is as lost as a DOWN one."""
    if info is None or info.status.lost:
        return NodeCondition.LOST
    if info.status.drain_requested and not info.reason.startswith(OWN_DRAIN_PREFIX):
        return NodeCondition.DRAINED_BY_OTHERS
    return NodeCondition.OK


def batch_exit(exit_code: str) -> int | None:
    """Slurm prints ExitCode as `status:signal`; a signal means no exit status of our own."""
    status, _, signal = exit_code.partition(":")
    if not status.isdigit() or (signal and signal != "0"):
        return None
    return int(status)


def job_end(info: JobInfo) -> JobEnd:
    if info.state in _END_BY_STATE:
        return _END_BY_STATE[info.state]
    code = batch_exit(info.exit_code)
    if info.state is JobState.COMPLETED:
        return JobEnd.FINISHED
    return _END_BY_EXIT.get(code, JobEnd.FAILED) if code is not None else JobEnd.FAILED


def job_view(info: JobInfo, nodes: Mapping[str, NodeInfo]) -> JobView | None:
    """None when the state is one this Slurm table does not know: never act on it."""
    phase = info.state.phase
    if phase is SlurmPhase.UNKNOWN:
        return None
    if phase is SlurmPhase.WAITING:
        return JobView(info.job_id, JobPhase.PENDING)
    if phase is SlurmPhase.ENDED:
        return JobView(info.job_id, JobPhase.ENDED, end=job_end(info))
    host = info.batch_host or None
    host_down = host is not None and node_condition(nodes.get(host)) is NodeCondition.LOST
    return JobView(info.job_id, JobPhase.RUNNING, batch_host=host, batch_host_down=host_down)


@dataclass(frozen=True)
class StepSample:
    rank: int
    node: str
    peer_group: str
    ended_at: datetime
    compute_s: float


def rank_compute(
    samples: Iterable[StepSample], *, now: datetime, bucket: timedelta, buckets: int
) -> tuple[RankCompute, ...]:
    """Per-rank median compute time in each of the last ``buckets`` buckets (oldest first).

    A rank missing from any bucket is left out: it is restarting or gone, and its empty bucket
    must not read as fast or slow."""
    start = now - bucket * buckets
    per_rank: dict[int, list[list[float]]] = defaultdict(lambda: [[] for _ in range(buckets)])
    identity: dict[int, tuple[str, str]] = {}
    for s in samples:
        index = int((s.ended_at - start) / bucket)
        if 0 <= index < buckets:
            per_rank[s.rank][index].append(s.compute_s)
            identity[s.rank] = (s.node, s.peer_group)
    return tuple(
        RankCompute(
            rank,
            identity[rank][0],
            tuple(statistics.median(b) for b in values),
            peer_group=identity[rank][1],
        )
        for rank, values in sorted(per_rank.items())
        if all(values)
    )
