"""The controller's policy as a table: observations in, actions out."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from slurmft.controller.decide import Policy, TrustPolicy, decide
from slurmft.controller.detect import RankBeat, RankCompute
from slurmft.controller.views import (
    Action,
    AgentSeen,
    ClusterView,
    DrainNode,
    EvictNode,
    ExcludeFromJob,
    ExcludeNode,
    FinishRun,
    GpuFault,
    JobEnd,
    JobPhase,
    JobView,
    NodeCondition,
    NodeView,
    NotifyHuman,
    RecordEvent,
    RecordRestarts,
    RequeueJob,
    RestartEvidence,
    RestartWorkers,
    RunView,
    SubmitAttempt,
)
from slurmft.core.budget import Restart, RestartBudget, Seen, Sighting
from slurmft.db.models import EventKind, FaultClass, NodeRole
from slurmft.db.states import RunState
from slurmft.gpu.api import FaultAction
from slurmft.gpu.lemons import SUSPECTED_CORRUPTION, XidOccurrence, judge_lemons

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
POLICY = Policy(straggler_window_buckets=3)
RUNNING = JobView("101", JobPhase.ACTIVE, batch_host="n1")


def _nodes(
    *, spares: int = 1, lost: tuple[str, ...] = (), drained: tuple[str, ...] = ()
) -> tuple[NodeView, ...]:
    names = [f"n{i}" for i in range(1, 4 + spares)]

    def condition(name: str) -> NodeCondition:
        if name in lost:
            return NodeCondition.LOST
        return NodeCondition.DRAINED_BY_OTHERS if name in drained else NodeCondition.OK

    return tuple(
        NodeView(n, NodeRole.ACTIVE if i < 3 else NodeRole.SPARE, condition(n))
        for i, n in enumerate(names)
    )


def _run(**kw: object) -> RunView:
    base = RunView(run_id="r1", nodes_needed=3, job=RUNNING, nodes=_nodes())
    return replace(base, **kw)  # type: ignore[arg-type]


def _xids(node: str, *runs: str) -> tuple[XidOccurrence, ...]:
    """Xid 13 on ``node`` once in each of ``runs``, within the lemon window."""
    return tuple(XidOccurrence(node, run, 13, NOW - timedelta(days=1)) for run in runs)


def _view(*runs: RunView, **kw: object) -> ClusterView:
    base = ClusterView(now=NOW, slurm_reachable=True, runs=runs, partition_nodes=6)
    return replace(base, **kw)  # type: ignore[arg-type]


def _summary(actions: list[Action]) -> list[tuple[str, str]]:
    """(action type, node or state or event kind) pairs: what a reader of the table checks."""
    out = []
    for a in actions:
        detail = getattr(a, "node", None) or ""
        if isinstance(a, RecordEvent):
            detail = a.kind.value + (f"@{a.node}" if a.node else "")
        elif isinstance(a, FinishRun):
            detail = a.state.value
        elif isinstance(a, RequeueJob | SubmitAttempt):
            detail = ",".join(sorted(a.exclude))
        elif isinstance(a, ExcludeFromJob):
            detail = ",".join(sorted(a.nodes))
        out.append((type(a).__name__, detail))
    return out


def _beats(**overrides: dict[str, float]) -> tuple[RankBeat, ...]:
    beats = []
    for rank in range(3):
        o = overrides.get(f"r{rank}", {})
        beats.append(
            RankBeat(
                rank,
                f"n{rank + 1}",
                "step",
                10,
                NOW - timedelta(seconds=o.get("ago", 1.0)),
                o.get("age", 1.0),
                300.0,
            )
        )
    return tuple(beats)


def _compute(slow_rank: int | None, factor: float = 1.3) -> tuple[RankCompute, ...]:
    return tuple(
        RankCompute(r, f"n{r + 1}", (factor if r == slow_rank else 1.0,) * 3) for r in range(3)
    )


def _agents(**ago: float) -> tuple[AgentSeen, ...]:
    """Each node's agent last reported 1 s ago, or `ago` seconds for the nodes named."""
    return tuple(AgentSeen(n.name, NOW - timedelta(seconds=ago.get(n.name, 1.0))) for n in _nodes())


def _exclusion_key(job_id: str, nodes: set[str]) -> str:
    """The key the exclusion of `nodes` from a waiting job is recorded under."""
    view = _view(_run(job=JobView(job_id, JobPhase.WAITING), excluded=frozenset(nodes)))
    (action,) = decide(view, POLICY)
    assert isinstance(action, ExcludeFromJob)
    return str(action.evidence["key"])


# n3's agent (its worker with it) has not reported for 90 s while the others report every
# second; its slurmd still answers, so Slurm calls the node fine.
FROZEN_NODE = {"beats": _beats(r2={"ago": 90.0}), "agents": _agents(n3=90.0)}
UNRESPONSIVE = [
    ("RecordEvent", "node_lost@n3"),
    ("ExcludeNode", "n3"),
    ("DrainNode", "n3"),
    ("EvictNode", "n3"),
]

XID79 = GpuFault("n2", FaultAction.DRAIN, "Xid 79 GPU has fallen off the bus (GPU 3)", 79, 3)
XID13 = GpuFault("n2", FaultAction.RESTART_APP, "Xid 13 graphics engine exception (GPU 0)", 13, 0)

CASES = [
    ("healthy run: nothing to do", _view(_run(beats=_beats(), compute=_compute(None))), []),
    (
        "Slurm unreachable: never act on stale information",
        _view(_run(nodes=_nodes(lost=("n2",))), slurm_reachable=False),
        [],
    ),
    ("pending job: wait", _view(_run(job=JobView("101", JobPhase.WAITING))), []),
    (
        "pending job, a node of its requeued attempt lost: record and exclude it, nothing else",
        _view(
            _run(
                job=JobView("101", JobPhase.WAITING),
                nodes=(NodeView("n2", NodeRole.ACTIVE, NodeCondition.LOST),),
            )
        ),
        [("RecordEvent", "node_lost@n2"), ("ExcludeNode", "n2")],
    ),
    (
        "requeued job waits: the run's removed nodes and the denylist go into its ExcNodeList",
        _view(
            _run(job=JobView("101", JobPhase.WAITING), excluded=frozenset({"n2", "n3"})),
            denylist=frozenset({"n9"}),
        ),
        [("ExcludeFromJob", "n2,n3,n9")],
    ),
    (
        "waiting job whose ExcNodeList was set for these nodes: nothing more",
        _view(
            _run(
                job=JobView("101", JobPhase.WAITING),
                excluded=frozenset({"n2"}),
                reported=frozenset({_exclusion_key("101", {"n2", "n9"})}),
            ),
            denylist=frozenset({"n9"}),
        ),
        [],
    ),
    (
        "waiting job set for fewer nodes than the run has removed now: set again",
        _view(
            _run(
                job=JobView("101", JobPhase.WAITING),
                excluded=frozenset({"n2", "n3"}),
                reported=frozenset({_exclusion_key("101", {"n2"})}),
            )
        ),
        [("ExcludeFromJob", "n2,n3")],
    ),
    (
        "active node lost: record, exclude; the spare joins",
        _view(_run(nodes=_nodes(lost=("n2",)))),
        [("RecordEvent", "node_lost@n2"), ("ExcludeNode", "n2")],
    ),
    (
        "lost node already excluded: nothing more",
        _view(_run(nodes=_nodes(lost=("n2",)), excluded=frozenset({"n2"}))),
        [],
    ),
    (
        "lost node with no spare left: requeue without it and the denylist, tell a human",
        _view(_run(nodes=_nodes(spares=0, lost=("n2",))), denylist=frozenset({"n9"})),
        [
            ("RecordEvent", "node_lost@n2"),
            ("ExcludeNode", "n2"),
            ("RequeueJob", "n2,n9"),
            ("NotifyHuman", ""),
        ],
    ),
    (
        "node drained by someone else: leave it, never undo it",
        _view(_run(nodes=_nodes(drained=("n3",)))),
        [("ExcludeNode", "n3")],
    ),
    (
        "batch host down: requeue without it",
        _view(_run(job=replace(RUNNING, batch_host_down=True))),
        [("RecordEvent", "batch_host_down@n1"), ("ExcludeNode", "n1"), ("RequeueJob", "n1")],
    ),
    (
        "Xid 79: exclude, drain",
        _view(_run(gpu_faults=(XID79,))),
        [("RecordEvent", "gpu_fault@n2"), ("ExcludeNode", "n2"), ("DrainNode", "n2")],
    ),
    (
        "Xid 79 on a node outside the run's allocation (another run's): nothing",
        _view(_run(gpu_faults=(replace(XID79, node="n9"),))),
        [],
    ),
    (
        "a lemon outside the run's allocation: nothing",
        _view(_run(gpu_faults=(replace(XID13, node="n9"),)), xid_history=_xids("n9", "r1", "r0")),
        [],
    ),
    (
        "Xid 79 with drains of GPU faults switched off: exclude from the run only",
        _view(_run(gpu_faults=(XID79,))),
        [("RecordEvent", "gpu_fault@n2"), ("ExcludeNode", "n2")],
    ),
    (
        "Xid 13 in one run: the run restarts, the node stays",
        _view(_run(gpu_faults=(XID13,))),
        [("RecordEvent", "gpu_fault@n2"), ("RestartWorkers", "n2")],
    ),
    (
        "Xid 13 on a node with such Xids in another run too (a lemon): excluded and drained",
        _view(_run(gpu_faults=(XID13,)), xid_history=_xids("n2", "r1", "r0")),
        [("RecordEvent", "gpu_fault@n2"), ("ExcludeNode", "n2"), ("DrainNode", "n2")],
    ),
    (
        "Xid 13 while another node is the lemon: this node stays",
        _view(_run(gpu_faults=(XID13,)), xid_history=_xids("n5", "r0", "r9") + _xids("n2", "r1")),
        [("RecordEvent", "gpu_fault@n2"), ("RestartWorkers", "n2")],
    ),
    (
        "Xid 13 again and again, but in this run only: not a lemon, the node stays",
        _view(_run(gpu_faults=(XID13,)), xid_history=_xids("n2", "r1", "r1", "r1")),
        [("RecordEvent", "gpu_fault@n2"), ("RestartWorkers", "n2")],
    ),
    (
        "drain refused by the rate limit: exclude and tell a human",
        _view(_run(gpu_faults=(XID79,)), drains_last_hour=4),
        [("RecordEvent", "gpu_fault@n2"), ("ExcludeNode", "n2"), ("NotifyHuman", "")],
    ),
    (
        "hung rank: record with evidence, restart its workers",
        _view(_run(beats=_beats(r1={"age": 400.0}))),
        [("RecordEvent", "hang@n2"), ("RestartWorkers", "n2")],
    ),
    (
        "hang already reported: no second restart",
        _view(
            _run(beats=_beats(r1={"age": 400.0}), reported=frozenset({"hang:1:step:overdue:10"}))
        ),
        [],
    ),
    (
        "the same rank hung again at a later step of the attempt: restarted again",
        _view(_run(beats=_beats(r1={"age": 400.0}), reported=frozenset({"hang:1:step:overdue:4"}))),
        [("RecordEvent", "hang@n2"), ("RestartWorkers", "n2")],
    ),
    (
        "frozen rank (SIGSTOP) while peers report",
        _view(_run(beats=_beats(r2={"ago": 60.0}))),
        [("RecordEvent", "hang@n3"), ("RestartWorkers", "n3")],
    ),
    (
        "node unresponsive (agent and workers silent, peers report): exclude, drain, evict",
        _view(_run(**FROZEN_NODE)),
        UNRESPONSIVE,
    ),
    (
        "agent silent for less than unresponsive_after_s (60 s): nothing yet",
        _view(_run(agents=_agents(n3=50.0))),
        [],
    ),
    (
        "frozen worker whose agent still reports (keep-alive): a hang, the workers restart",
        _view(_run(beats=_beats(r2={"ago": 90.0}), agents=_agents())),
        [("RecordEvent", "hang@n3"), ("RestartWorkers", "n3")],
    ),
    (
        "unresponsive node past the drain limits: excluded and evicted, a human told",
        _view(_run(**FROZEN_NODE), drains_last_hour=4),
        [UNRESPONSIVE[0], UNRESPONSIVE[1], ("NotifyHuman", ""), UNRESPONSIVE[3]],
    ),
    (
        "unresponsive node Slurm already calls lost: a node loss, nothing to evict",
        _view(_run(**FROZEN_NODE | {"nodes": _nodes(lost=("n3",))})),
        [("RecordEvent", "node_lost@n3"), ("ExcludeNode", "n3")],
    ),
    (
        "unresponsive node already out of the run: nothing more",
        _view(_run(**FROZEN_NODE | {"excluded": frozenset({"n3"})})),
        [],
    ),
    (
        "every agent silent: the channel, never a node",
        _view(
            _run(
                beats=_beats(r0={"ago": 90.0}, r1={"ago": 90.0}, r2={"ago": 90.0}),
                agents=_agents(n1=90.0, n2=90.0, n3=90.0, n4=90.0),
            )
        ),
        [("RecordEvent", "channel_silent")],
    ),
    (
        "whole run silent: channel problem, no restart",
        _view(_run(beats=_beats(r0={"ago": 90.0}, r1={"ago": 90.0}, r2={"ago": 90.0}))),
        [("RecordEvent", "channel_silent")],
    ),
    ("plain torchrun script (no heartbeats): silence is never a hang", _view(_run()), []),
    (
        "straggler with a spare: exclude, a spare replaces it; no drain yet",
        _view(_run(compute=_compute(1))),
        [("RecordEvent", "straggler@n2"), ("ExcludeNode", "n2")],
    ),
    (
        "straggler in its third window: drained too",
        _view(_run(compute=_compute(1)), straggler_windows={"n2": 2}),
        [("RecordEvent", "straggler@n2"), ("ExcludeNode", "n2"), ("DrainNode", "n2")],
    ),
    (
        "a straggler on a node outside the run's allocation (its heartbeats said so): nothing",
        _view(
            _run(compute=_compute(1), nodes=_nodes()[:1] + _nodes()[2:]),
            straggler_windows={"n2": 2},
        ),
        [],
    ),
    (
        "straggler without a spare: recorded, kept (slow beats smaller)",
        _view(_run(nodes=_nodes(spares=0), compute=_compute(1))),
        [("RecordEvent", "straggler@n2")],
    ),
    (
        "job finished",
        _view(_run(job=JobView("101", JobPhase.ENDED, JobEnd.FINISHED))),
        [("FinishRun", "completed")],
    ),
    (
        "time limit: resubmit without the denylist, not charged",
        _view(
            _run(job=JobView("101", JobPhase.ENDED, JobEnd.TIME_LIMIT), excluded=frozenset({"n4"})),
            denylist=frozenset({"n9"}),
        ),
        [("RecordEvent", "time_limit"), ("SubmitAttempt", "n4,n9")],
    ),
    (
        "preempted (PreemptMode=CANCEL ends it PREEMPTED): resubmit, not charged",
        _view(_run(job=JobView("101", JobPhase.ENDED, JobEnd.PREEMPTED))),
        [("RecordEvent", "preempted"), ("SubmitAttempt", "")],
    ),
    (
        "scancel outside slurmft (owner or admin): the run ends cancelled, no resubmission",
        _view(_run(job=JobView("101", JobPhase.ENDED, JobEnd.CANCELLED))),
        [("FinishRun", "cancelled")],
    ),
    (
        "ended job already resubmitted (or waiting for its owner): not again",
        _view(
            _run(
                job=JobView("101", JobPhase.ENDED, JobEnd.TIME_LIMIT),
                reported=frozenset({"end:101", "resubmit:101"}),
            )
        ),
        [],
    ),
    (
        "cancelled by its owner: done",
        _view(_run(job=JobView("101", JobPhase.ENDED, JobEnd.CANCELLED), cancel_requested=True)),
        [("FinishRun", "cancelled")],
    ),
    (
        "job failed with budget left: resubmit",
        _view(_run(job=JobView("101", JobPhase.ENDED, JobEnd.FAILED))),
        [("SubmitAttempt", "")],
    ),
    (
        "job failed at the cap: stop",
        _view(
            _run(
                job=JobView("101", JobPhase.ENDED, JobEnd.FAILED),
                budget=RestartBudget(restarts_without_progress=5),
            )
        ),
        [("FinishRun", "stopped"), ("NotifyHuman", "")],
    ),
    (
        "batch step gave up: stopped, a human told",
        _view(_run(job=JobView("101", JobPhase.ENDED, JobEnd.GIVE_UP))),
        [("FinishRun", "stopped"), ("NotifyHuman", "")],
    ),
    (
        "owner cancels a running run: cancel the job, end the run",
        _view(_run(cancel_requested=True)),
        [("FinishRun", "cancelled")],
    ),
    (
        "owner cancels a pending run",
        _view(_run(cancel_requested=True, job=JobView("101", JobPhase.WAITING))),
        [("FinishRun", "cancelled")],
    ),
    (
        "running past the cap: stop and cancel, a human told",
        _view(_run(budget=RestartBudget(restarts_without_progress=6))),
        [("FinishRun", "stopped"), ("NotifyHuman", "")],
    ),
]


@pytest.mark.parametrize(("name", "view", "expected"), CASES, ids=[c[0] for c in CASES])
def test_decision_table(name: str, view: ClusterView, expected: list[tuple[str, str]]) -> None:
    policy = POLICY
    if "switched off" in name:
        policy = replace(POLICY, trust=TrustPolicy(drain_gpu_faults=False))
    assert _summary(decide(view, policy)) == expected


def test_reasons_are_readable_in_slurm() -> None:
    actions = decide(
        _view(
            _run(gpu_faults=(XID79,)), _run(run_id="r2", compute=_compute(2)), partition_nodes=100
        ),
        replace(POLICY, trust=TrustPolicy(straggler_drain_after_windows=1)),
    )
    drains = [a for a in actions if isinstance(a, DrainNode)]
    assert [d.reason for d in drains] == [
        "slurmft: Xid 79 GPU has fallen off the bus (GPU 3)",
        "slurmft: straggler rank 2 +30% over median, slow in 1 windows",
    ]


def test_an_unresponsive_node_is_drained_before_it_is_set_down() -> None:
    """DOWN alone does not stick while the node's slurmd answers: the drain must come first."""
    actions = decide(_view(_run(**FROZEN_NODE)), POLICY)
    drain, evict = (
        next(a for a in actions if isinstance(a, kind)) for kind in (DrainNode, EvictNode)
    )
    assert actions.index(drain) < actions.index(evict)
    assert (
        evict.reason
        == "slurmft: node n3 unresponsive: its agent silent for 90s while its peers report"
    )
    assert evict.evidence == {"seconds": 90.0}


def _reported(actions: list[Action]) -> frozenset[str]:
    """The keys the store holds once ``actions`` are recorded (observe._reported_keys)."""
    keys = [a.key if isinstance(a, RecordEvent) else a.evidence.get("key") for a in actions]
    return frozenset(k for k in keys if isinstance(k, str))


@pytest.mark.parametrize(
    ("case", "run", "first", "then"),
    [
        (
            "batch host down",
            _run(job=replace(RUNNING, batch_host_down=True, silent_nodes=frozenset({"n1"}))),
            [("RecordEvent", "batch_host_down@n1"), ("ExcludeNode", "n1"), ("EvictNode", "n1")],
            [("RequeueJob", "n1")],
        ),
        (
            "no spare left",
            _run(
                job=replace(RUNNING, silent_nodes=frozenset({"n2"})),
                nodes=_nodes(spares=0, lost=("n2",)),
            ),
            [("RecordEvent", "node_lost@n2"), ("ExcludeNode", "n2"), ("EvictNode", "n2")],
            [("RequeueJob", "n2"), ("NotifyHuman", "")],
        ),
    ],
)
def test_a_gpu_job_is_requeued_only_once_slurm_shows_its_silent_nodes_down(
    case: str, run: RunView, first: list[tuple[str, str]], then: list[tuple[str, str]]
) -> None:
    """Slurm 22.05 breaks the GPUs of a job requeued while it holds a silent node that is not
    DOWN yet (docs/slurm.md): the daemon sets it DOWN, and requeues on a later pass."""
    job = run.job
    assert job is not None
    gpu_run = replace(run, steps_ask_gres=True)
    fenced = decide(_view(gpu_run), POLICY)
    assert _summary(fenced) == first
    assert fenced[-1].reason.startswith(f"slurmft: node {first[-1][1]} silent (slurmd not")
    # Recorded, and Slurm does not show the DOWN yet (or refused it): nothing until it does.
    node = first[-1][1]
    waiting = replace(gpu_run, excluded=frozenset({node}), reported=_reported(fenced))
    assert decide(_view(waiting), POLICY) == []
    down = replace(waiting, job=replace(job, silent_nodes=frozenset()))
    assert _summary(decide(_view(down), POLICY)) == then
    # A job whose steps ask for no GRES is requeued at once, its node left to Slurm.
    assert _summary(decide(_view(run), POLICY)) == [*first[:-1], *then]


CONFIRM = replace(POLICY, confirm_s=10.0)


@pytest.mark.parametrize(
    ("case", "run", "acted"),
    [
        (
            "batch host",
            _run(job=replace(RUNNING, batch_host_down=True, batch_host_lost_since=NOW)),
            [("RecordEvent", "batch_host_down@n1"), ("ExcludeNode", "n1"), ("RequeueJob", "n1")],
        ),
        (
            "a node with no spare left",
            _run(nodes=_nodes(spares=0, lost=("n2",))),
            [
                ("RecordEvent", "node_lost@n2"),
                ("ExcludeNode", "n2"),
                ("RequeueJob", "n2"),
                ("NotifyHuman", ""),
            ],
        ),
    ],
)
def test_slurms_word_that_a_node_is_lost_is_acted_on_only_once_confirmed(
    case: str, run: RunView, acted: list[tuple[str, str]]
) -> None:
    """A node Slurm calls lost for one pass, while its agent still reports, costs nothing (a
    just-resumed node reads not-responding for under a second): it is acted on once it has
    held for confirm_s, or at once when the node's agent has been silent as long too."""
    node = acted[0][1].split("@")[-1]
    talking = _agents()  # every agent reported a second ago
    for lost_s, agents, expected in [
        (0, talking, []),
        (9, talking, []),
        (10, talking, acted),  # held for confirm_s
        (0, _agents(**{node: 10.0}), acted),  # its agent silent as long: at once
        (0, _agents(**{node: 9.0}), []),
    ]:
        view = _view(replace(_lost_for(run, node, lost_s), agents=agents))
        assert _summary(decide(view, CONFIRM)) == expected, (lost_s, agents)


def test_a_gpu_jobs_node_silent_for_a_moment_is_waited_for_not_set_down() -> None:
    """n2 is lost for good and no spare is left: the GPU job must be requeued. n3 reads not
    responding this pass, its agent still reporting: n2 is set DOWN, n3 is not, and the
    requeue waits for both (a requeue while n3 is held, not DOWN, would break the GPUs)."""
    nodes = _nodes(spares=0, lost=("n2", "n3"))
    run = _run(
        job=replace(RUNNING, silent_nodes=frozenset({"n2", "n3"})),
        nodes=tuple(replace(n, lost_since=NOW) if n.name == "n3" else n for n in nodes),
        agents=_agents(n2=30.0),
        steps_ask_gres=True,
    )
    actions = decide(_view(run), CONFIRM)
    assert _summary(actions) == [
        ("RecordEvent", "node_lost@n2"),
        ("ExcludeNode", "n2"),
        ("EvictNode", "n2"),
    ]
    # n2 DOWN (out of the job), n3 still silent and unconfirmed: nothing yet.
    waiting = replace(
        run,
        job=replace(RUNNING, silent_nodes=frozenset({"n3"})),
        excluded=frozenset({"n2"}),
        reported=_reported(actions),
    )
    assert decide(_view(waiting), CONFIRM) == []


def _lost_for(run: RunView, node: str, seconds: float) -> RunView:
    """``run`` with Slurm calling ``node`` lost for ``seconds`` (its batch host, or a node)."""
    since = NOW - timedelta(seconds=seconds)
    if run.job is not None and run.job.batch_host == node and run.job.batch_host_down:
        return replace(run, job=replace(run.job, batch_host_lost_since=since))
    nodes = tuple(replace(n, lost_since=since) if n.name == node else n for n in run.nodes)
    return replace(run, nodes=nodes)


def test_one_node_is_drained_once_per_pass() -> None:
    both = (XID79, replace(XID79, gpu=4, description="Xid 48 double-bit ECC (GPU 4)", xid=48))
    actions = decide(_view(_run(gpu_faults=both)), POLICY)
    assert sum(isinstance(a, DrainNode) for a in actions) == 1
    assert sum(isinstance(a, RecordEvent) for a in actions) == 2


def test_drain_fraction_cap_allows_at_least_one() -> None:
    view = _view(
        _run(gpu_faults=(XID79,)),
        _run(run_id="r2", gpu_faults=(replace(XID79, node="n3"),)),
        partition_nodes=6,
    )
    kinds = [type(a) for a in decide(view, POLICY)]
    assert kinds.count(DrainNode) == 1 and kinds.count(NotifyHuman) == 1


def test_stopped_run_cancels_its_job_with_the_budget_reason() -> None:
    budget = RestartBudget()
    for _ in range(6):
        budget = budget.charge(Restart(FaultClass.USER_CODE))
    action, notice = decide(_view(_run(budget=budget)), POLICY)
    assert isinstance(action, FinishRun) and action.state is RunState.STOPPED
    assert action.job_id == "101" and "restarts in a row without progress" in action.reason
    assert isinstance(notice, NotifyHuman) and action.reason in notice.reason


def test_a_failed_job_charges_the_budget_it_resubmits_with() -> None:
    view = _view(
        _run(
            job=JobView("101", JobPhase.ENDED, JobEnd.FAILED),
            budget=RestartBudget(restarts_without_progress=2),
        )
    )
    (action,) = decide(view, POLICY)
    assert isinstance(action, SubmitAttempt)
    assert (action.restarts_without_progress, action.evidence["key"]) == (3, "resubmit:101")


def test_events_carry_keys_and_classes() -> None:
    actions = decide(_view(_run(nodes=_nodes(lost=("n2",)))), POLICY)
    event = actions[0]
    assert isinstance(event, RecordEvent)
    assert (event.kind, event.fault_class, event.key) == (
        EventKind.NODE_LOST,
        FaultClass.HARDWARE,
        "lost:n2",
    )
    assert isinstance(actions[1], ExcludeNode)
    assert not any(isinstance(a, RestartWorkers) for a in actions)


def test_policy_comes_from_the_config() -> None:
    from pathlib import Path

    from slurmft.config import load_config

    config = load_config(
        environ={},
        system_file=Path("/nonexistent"),
        overrides=[
            "trust.drains_per_hour=1",
            "policy.straggler_window_s=180",
            "trust.drain_gpu_faults=false",
        ],
    )
    policy = Policy.from_config(config)
    # Five buckets whatever the window: slow in each of them is "sustained".
    assert (policy.straggler_window_buckets, policy.straggler_bucket) == (5, timedelta(seconds=36))
    assert policy.trust == TrustPolicy(drain_gpu_faults=False, drains_per_hour=1)


def test_an_agent_reported_fault_is_acted_on_once_and_not_recorded_again() -> None:
    reported = replace(XID79, event_id=42)
    actions = decide(_view(_run(gpu_faults=(reported,))), POLICY)
    assert _summary(actions) == [("ExcludeNode", "n2"), ("DrainNode", "n2")]
    assert all(a.evidence["key"] == "gpu:42" for a in actions)
    assert decide(_view(_run(gpu_faults=(reported,), reported=frozenset({"gpu:42"}))), POLICY) == []


def _failure(at: datetime, ended_round: str) -> Sighting:
    return Sighting(Seen.FAILURE, at, agent="a", rank=0, round=ended_round)


def test_the_crash_loop_count_is_decided_from_the_evidence_and_recorded_once() -> None:
    """gather reads the reports; decide counts them (the restarts since the newest checkpoint,
    one per rendezvous round), says what to record, and stops the run past the cap."""
    start = NOW - timedelta(minutes=20)
    progress = Sighting(Seen.CHECKPOINT, start, step=20)
    failures = tuple(_failure(start + timedelta(seconds=90 * i), f"7.1/{i}") for i in range(1, 4))
    lost = Sighting(Seen.NODE_REMOVED, start + timedelta(seconds=91))  # the first one: a node
    evidence = RestartEvidence(
        since=start - timedelta(hours=1), progress=progress, restarts=failures, causes=(lost,)
    )
    run = _run(restarts=evidence, budget=RestartBudget(restarts_without_progress=4))
    (record, *rest) = decide(_view(run), POLICY)
    assert isinstance(record, RecordRestarts) and rest == []
    assert (record.restarts_without_progress, record.last_progress_at) == (2, start)
    assert [(r.key, r.cause, r.node_removed) for r in record.restarts] == [
        ("7.1/1", FaultClass.HARDWARE, True),
        ("7.1/2", FaultClass.USER_CODE, False),
        ("7.1/3", FaultClass.USER_CODE, False),
    ]
    # The next pass, with all of it recorded: nothing to do.
    recorded = {r.key: (r.cause, r.node_removed) for r in record.restarts}
    again = replace(
        run,
        budget=RestartBudget(restarts_without_progress=2),
        restarts=replace(evidence, progress_at=start, recorded=recorded),
    )
    assert decide(_view(again), POLICY) == []
    assert not record.progress_only
    # A newer checkpoint: the count falls to nothing; news, logged as such.
    newer = Sighting(Seen.CHECKPOINT, start + timedelta(minutes=10), step=40)
    checkpointed = replace(again, restarts=replace(again.restarts, progress=newer))
    (reset,) = decide(_view(checkpointed), POLICY)
    assert isinstance(reset, RecordRestarts) and reset.restarts_without_progress == 0
    assert not reset.progress_only
    # Progress again, no restart since: only the progress moves (debug, not news every pass).
    settled = replace(
        again,
        budget=RestartBudget(restarts_without_progress=0),
        restarts=replace(again.restarts, progress=newer, progress_at=newer.at),
    )
    newest = Sighting(Seen.CHECKPOINT, start + timedelta(minutes=11), step=50)
    checkpointed = replace(settled, restarts=replace(settled.restarts, progress=newest))
    (moved,) = decide(_view(checkpointed), POLICY)
    assert isinstance(moved, RecordRestarts) and moved.progress_only
    assert (moved.restarts_without_progress, moved.last_progress_at) == (0, newest.at)
    # Four more failures in a row: past the cap of 5, the run stops, the count recorded first.
    more = tuple(_failure(start + timedelta(seconds=90 * i), f"7.1/{i}") for i in range(4, 8))
    spent = replace(again, restarts=replace(again.restarts, restarts=failures + more))
    actions = decide(_view(spent), POLICY)
    assert _summary(actions)[0][0] == "RecordRestarts"
    assert actions[0].restarts_without_progress == 6  # type: ignore[attr-defined]
    assert ("FinishRun", "stopped") in _summary(actions)
    assert "crash loop: 5 restarts in a row without progress" in actions[1].reason


def _at_the_cap_then(*restarts_s_ago: float) -> RestartEvidence:
    """Five restarts of the user's code in a row (the cap), then more, ``restarts_s_ago``."""
    earlier = tuple(_failure(NOW - timedelta(seconds=600 - 90 * i), f"7.1/{i}") for i in range(5))
    newer = tuple(
        _failure(NOW - timedelta(seconds=ago), f"7.1/{i}")
        for i, ago in enumerate(restarts_s_ago, 5)
    )
    return RestartEvidence(since=NOW - timedelta(hours=1), restarts=(*earlier, *newer))


def test_a_restart_is_free_in_the_pass_that_takes_its_node_out() -> None:
    """The daemon was down: the restart the loss caused and Slurm's word that n2 is lost are
    both new to this pass. The pass that records the loss counts the restart free, with its
    cause, not as the user's code for one pass: at the cap, that pass would stop the run."""
    lost = _lost_for(_run(nodes=_nodes(lost=("n2",))), "n2", 10)
    run = replace(lost, restarts=_at_the_cap_then(12), agents=_agents())
    actions = decide(_view(run), CONFIRM)
    assert _summary(actions) == [
        ("RecordRestarts", ""),
        ("RecordEvent", "node_lost@n2"),
        ("ExcludeNode", "n2"),
    ]
    record = actions[0]
    assert isinstance(record, RecordRestarts)
    assert record.restarts_without_progress == 5
    assert [(r.key, r.cause, r.node_removed) for r in record.restarts] == [
        *((f"7.1/{i}", FaultClass.USER_CODE, False) for i in range(5)),
        ("7.1/5", FaultClass.HARDWARE, True),
    ]


@pytest.mark.parametrize(
    ("case", "restarts_s_ago", "lost_s", "agents", "stopped"),
    [
        ("the restart just reported, nothing known yet", (2,), None, _agents(), False),
        ("n2 lost for a moment only, unconfirmed", (12,), 1, _agents(), False),
        ("n2's agent silent, Slurm says nothing", (12,), None, _agents(n2=12.0), False),
        ("n2's agent silent past the eviction bound", (70,), None, _agents(n2=70.0), True),
        ("a crash loop: nothing in doubt", (12,), None, _agents(), True),
        (
            "a fast crash loop: a newer restart every few seconds",
            (12, 8, 4, 1),
            None,
            _agents(),
            True,
        ),
    ],
)
def test_a_crash_loop_stop_waits_while_a_node_loss_may_still_be_its_cause(
    case: str, restarts_s_ago: tuple[float, ...], lost_s: float | None,
    agents: tuple[AgentSeen, ...], stopped: bool,
) -> None:  # fmt: skip
    """At the cap, one more restart stops the run, unless a node loss may still turn out to be
    its cause (then it is free): that restart reported under ``confirm_s`` ago, a node Slurm
    calls lost without confirmation, an agent gone silent that is not evicted yet. The restarts
    after it do not hold the stop any longer."""
    run = _run(restarts=_at_the_cap_then(*restarts_s_ago), agents=agents)
    if lost_s is not None:
        run = _lost_for(replace(run, nodes=_nodes(lost=("n2",))), "n2", lost_s)
    actions = decide(_view(run), CONFIRM)
    count = 5 + len(restarts_s_ago)
    assert actions[0].restarts_without_progress == count  # type: ignore[attr-defined]
    assert (("FinishRun", "stopped") in _summary(actions)) is stopped, _summary(actions)


def test_a_run_whose_view_cannot_be_decided_is_recorded_and_the_others_are_decided() -> None:
    """Issue 14, item 3: deciding for one run fails (its data, a bug): that run gets a
    control-error event, once per attempt, and every other run is decided as usual."""
    broken = _run(run_id="ra", nodes=(None,))  # not a NodeView: deciding for it raises
    lost = _run(run_id="rb", nodes=_nodes(lost=("n2",)))
    actions = decide(_view(broken, lost), POLICY)
    (error,) = [a for a in actions if a.run_id == "ra"]
    assert isinstance(error, RecordEvent) and error.kind is EventKind.CONTROL_ERROR
    assert error.reason.startswith("control pass: deciding failed: AttributeError")
    assert ("ExcludeNode", "n2") in _summary([a for a in actions if a.run_id == "rb"])
    again = replace(broken, reported=frozenset({error.key}))
    assert [a.run_id for a in decide(_view(again, lost), POLICY)].count("ra") == 0


@pytest.mark.parametrize(
    ("started_s_ago", "expected"),
    [
        (20.0, []),  # silent 90 s, but the daemon has listened for 20 s only: nothing yet
        (70.0, UNRESPONSIVE),  # silent for longer than 60 s while the daemon listened
    ],
)
def test_silence_is_counted_from_the_daemons_start_at_the_earliest(
    started_s_ago: float, expected: list[tuple[str, str]]
) -> None:
    """After a restart each agent resends what it buffered when its own retry comes round: one
    that comes late was silent to a daemon that was not there, not unresponsive. The same for
    a rank's heartbeats (FROZEN_NODE's rank 2 last heard 90 s ago)."""
    assert _summary(decide(_view(_run(**FROZEN_NODE)), POLICY)) == UNRESPONSIVE  # as before
    view = _view(_run(**FROZEN_NODE), listening_since=NOW - timedelta(seconds=started_s_ago))
    assert _summary(decide(view, POLICY)) == expected


def test_a_numerical_fault_that_stops_the_run_stops_it_with_its_words() -> None:
    why = "non-finite loss at step 28, again when re-run on the same data (samples 7): ..."
    action, notice = decide(_view(_run(numerical_stop=why)), POLICY)
    assert isinstance(action, FinishRun) and action.state is RunState.STOPPED
    assert (action.job_id, action.reason) == ("101", why)
    assert isinstance(notice, NotifyHuman) and why in notice.reason
    ended = _run(numerical_stop=why, job=JobView("101", JobPhase.ENDED, JobEnd.FAILED))
    action, _ = decide(_view(ended), POLICY)  # not resubmitted: it would meet the fault again
    assert isinstance(action, FinishRun) and action.job_id is None


def test_numerical_faults_not_reproduced_in_two_runs_make_a_node_a_lemon() -> None:
    suspected = tuple(
        XidOccurrence("n2", run, SUSPECTED_CORRUPTION, NOW - timedelta(days=1))
        for run in ("a", "b")
    )
    verdicts = judge_lemons(suspected, now=NOW, min_runs=2)
    assert verdicts["n2"].is_lemon
    assert verdicts["n2"].reason == (
        "slurmft: lemon: numerical faults not reproduced on re-run in 2 different runs "
        "within 14 days"
    )
    one = judge_lemons(suspected[:1] + _xids("n2", "c"), now=NOW, min_runs=3)
    assert "Xid 13 and numerical faults not reproduced on re-run in 2 run(s)" in one["n2"].reason
