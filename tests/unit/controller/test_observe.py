"""Observation mapping on output recorded from the real Slurm 22.05 commands."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from slurmft.controller.decide import Policy, decide
from slurmft.controller.observe import (
    StepSample,
    _node_views,
    batch_exit,
    job_end,
    job_view,
    node_condition,
    rank_compute,
)
from slurmft.controller.views import (
    AgentSeen,
    ClusterView,
    JobEnd,
    JobPhase,
    NodeCondition,
    NodeView,
    RunView,
)
from slurmft.db.models import Attempt, NodeRole
from slurmft.slurm.api import JobInfo
from slurmft.slurm.lost_sightings import LostSightings
from slurmft.slurm.parse import job_from_scontrol, parse_scontrol_records, parse_sinfo_nodes
from slurmft.slurm.states import JobState

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "slurm" / "22.05"


def _stdout(name: str) -> str:
    return json.loads((FIXTURES / f"{name}.json").read_text())["stdout"]


def _job(name: str) -> JobInfo:
    return job_from_scontrol(parse_scontrol_records(_stdout(name))[0])


def test_node_conditions_from_recorded_sinfo() -> None:
    down = parse_sinfo_nodes(_stdout("sinfo_nodes_down"))
    drained = parse_sinfo_nodes(_stdout("sinfo_nodes_drained"))
    assert node_condition(down["n1"]) is NodeCondition.LOST  # down*, not responding
    assert node_condition(down["n2"]) is NodeCondition.OK
    assert node_condition(drained["n3"]) is NodeCondition.OK  # our own drain ("slurmft: ...")
    assert node_condition(drained["n6"]) is NodeCondition.DRAINED_BY_OTHERS
    assert node_condition(None) is NodeCondition.LOST


def test_running_job_whose_batch_host_died() -> None:
    job = _job("show_job_batch_host_down")
    nodes = parse_sinfo_nodes(_stdout("sinfo_nodes_down"))
    view = job_view(job, nodes)
    assert view is not None and view.phase is JobPhase.ACTIVE
    assert view.batch_host == "n1" and view.batch_host_down


def test_a_held_node_whose_slurmd_is_silent_is_named_until_slurm_marks_it_down() -> None:
    # A GRES job is requeued only once none is left (decide._silent_held): recorded sinfo of a
    # node not responding (mixed*), then of the same node DOWN (down*).
    job = dataclasses.replace(_job("show_job_batch_host_down"), nodes=("n1", "n2", "n3"))
    silent = job_view(job, parse_sinfo_nodes(_stdout("sinfo_nodes_not_responding")))
    down = job_view(job, parse_sinfo_nodes(_stdout("sinfo_nodes_down")))
    assert silent is not None and silent.batch_host_down and silent.silent_nodes == {"n1"}
    assert down is not None and down.batch_host_down and down.silent_nodes == frozenset()


def test_a_lost_node_is_dated_from_its_first_sighting_until_it_answers_again() -> None:
    """Recorded sinfo: n1 not responding (mixed*), then DOWN (down*), then all answering."""
    sightings, t0 = LostSightings(), datetime(2026, 12, 2, 3, 0, tzinfo=UTC)
    silent = parse_sinfo_nodes(_stdout("sinfo_nodes_not_responding"))
    down = parse_sinfo_nodes(_stdout("sinfo_nodes_down"))
    healthy = parse_sinfo_nodes(_stdout("sinfo_nodes_drained"))
    assert sightings.update(silent, t0) == {"n1": t0}
    assert sightings.update(down, t0 + timedelta(seconds=5)) == {"n1": t0}  # the same loss
    assert sightings.update(healthy, t0 + timedelta(seconds=10)) == {}
    later = t0 + timedelta(seconds=15)
    assert sightings.update(silent, later) == {"n1": later}  # a new loss, dated anew
    job = dataclasses.replace(_job("show_job_batch_host_down"), nodes=("n1", "n2", "n3"))
    view = job_view(job, silent, {"n1": t0})
    assert view is not None and view.batch_host_lost_since == t0
    views = _node_views(None, None, job, silent, {"n1": t0})  # type: ignore[arg-type]
    assert [(n.name, n.condition, n.lost_since) for n in views] == [
        ("n1", NodeCondition.LOST, t0),
        ("n2", NodeCondition.OK, None),
        ("n3", NodeCondition.OK, None),
    ]


def test_one_poll_of_a_batch_host_not_responding_requeues_nothing_two_polls_do() -> None:
    """Recorded scontrol (a running job on n1-n3, batch host n1) and sinfo (n1 `mixed*`) through
    observe's sightings and decide, as the daemon's passes do, the agents reporting."""
    job = dataclasses.replace(_job("show_job_batch_host_down"), nodes=("n1", "n2", "n3"))
    silent = parse_sinfo_nodes(_stdout("sinfo_nodes_not_responding"))
    policy, sightings = Policy(confirm_s=10.0), LostSightings()
    t0 = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)

    def decided(now: datetime) -> list[str]:
        view = job_view(job, silent, sightings.update(silent, now))
        run = RunView("r1", 3, view, agents=tuple(AgentSeen(n, now) for n in job.nodes))
        return [type(a).__name__ for a in decide(ClusterView(now, True, (run,)), policy)]

    assert decided(t0) == []  # one poll: Slurm's word alone
    assert decided(t0 + timedelta(seconds=5)) == []
    assert decided(t0 + timedelta(seconds=10)) == ["RecordEvent", "ExcludeNode", "RequeueJob"]


def test_a_requeued_job_completing_on_its_dead_batch_host_is_not_requeued_again() -> None:
    # Seen on the local cluster: after `scontrol requeue` the job reads COMPLETING, still with
    # the dead BatchHost, until slurmctld gives up on that node; a second requeue then fails.
    running = _job("show_job_batch_host_down")
    completing = dataclasses.replace(running, state=JobState.COMPLETING)
    view = job_view(completing, parse_sinfo_nodes(_stdout("sinfo_nodes_down")))
    assert view is not None and view.phase is JobPhase.ACTIVE and not view.batch_host_down


def test_running_job_with_a_live_batch_host() -> None:
    view = job_view(_job("show_job_running"), parse_sinfo_nodes(_stdout("sinfo_nodes_drained")))
    assert view is not None and view.phase is JobPhase.ACTIVE and not view.batch_host_down


def test_ended_and_waiting_jobs() -> None:
    completed = job_view(_job("show_job_completed"), {})
    assert completed is not None and (completed.phase, completed.end) == (
        JobPhase.ENDED,
        JobEnd.FINISHED,
    )
    requeued = job_view(_job("show_job_pending_excluded"), {})
    assert requeued is not None and requeued.phase is JobPhase.WAITING


@pytest.mark.parametrize(
    ("state", "exit_code", "end"),
    [
        (JobState.TIMEOUT, "0:15", JobEnd.TIME_LIMIT),
        (JobState.PREEMPTED, "0:15", JobEnd.PREEMPTED),
        (JobState.CANCELLED, "0:15", JobEnd.CANCELLED),
        (JobState.NODE_FAIL, "0:0", JobEnd.NODE_FAIL),
        (JobState.COMPLETED, "0:0", JobEnd.FINISHED),
        (JobState.FAILED, "3:0", JobEnd.GIVE_UP),
        (JobState.FAILED, "4:0", JobEnd.NODE_FAIL),
        (JobState.FAILED, "1:0", JobEnd.FAILED),
        (JobState.FAILED, "0:9", JobEnd.FAILED),
        (JobState.OUT_OF_MEMORY, "0:125", JobEnd.FAILED),
    ],
)
def test_job_end_table(state: JobState, exit_code: str, end: JobEnd) -> None:
    assert job_end(JobInfo("1", state, exit_code=exit_code)) is end


def test_batch_exit_parsing() -> None:
    assert [batch_exit(c) for c in ("75:0", "0:0", "0:9", "", "x:0")] == [75, 0, None, None, None]


def test_unknown_state_is_never_acted_on() -> None:
    assert job_view(JobInfo("1", JobState.UNKNOWN), {}) is None


T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_rank_compute_buckets_per_minute_medians() -> None:
    samples = [
        StepSample(rank, f"n{rank + 1}", "", T0 - timedelta(seconds=s), compute)
        for rank, compute in ((0, 1.0), (1, 1.3), (2, 1.0))
        for s in range(5, 180, 10)
    ]
    samples.append(StepSample(3, "n4", "", T0 - timedelta(seconds=20), 1.0))  # newcomer
    samples.append(StepSample(0, "n1", "", T0 - timedelta(hours=1), 99.0))  # out of window
    computes = rank_compute(samples, now=T0, bucket=timedelta(minutes=1), buckets=3)
    assert [(c.rank, c.buckets) for c in computes] == [
        (0, (1.0, 1.0, 1.0)),
        (1, (1.3, 1.3, 1.3)),
        (2, (1.0, 1.0, 1.0)),
    ]


def test_a_node_the_shrunk_job_no_longer_holds_is_lost_when_only_the_nodelist_names_it() -> None:
    """The daemon recorded n2's loss and was killed before it took n2 out of the run; when it
    is back, Slurm has shrunk the job to n1,n3,n4 and only the attempt's first-seen nodelist
    still names n2. Seen in the suite under load; before, n2 vanished from the view."""
    attempt = Attempt(run_id="r1", number=1, slurm_job_id="11", nodelist="n1,n2,n3,n4")
    shrunk = JobInfo("11", JobState.RUNNING, nodes=("n1", "n3", "n4"), batch_host="n1")
    views = _node_views(None, attempt, shrunk, {})  # type: ignore[arg-type]
    assert NodeView("n2", NodeRole.ACTIVE, NodeCondition.LOST) in views
    assert [v.name for v in views] == ["n1", "n2", "n3", "n4"]
    # A job that is ending gives its nodes back one by one: those are not lost, and nothing is
    # taken out of the run for them (seen in the suite: a preempted job's freed nodes read as
    # lost, and the ending job was requeued without them instead of resubmitted).
    ending = dataclasses.replace(shrunk, state=JobState.COMPLETING)
    views = _node_views(None, attempt, ending, {})  # type: ignore[arg-type]
    assert [v.name for v in views] == ["n1", "n3", "n4"]  # n2 is not in the view at all
