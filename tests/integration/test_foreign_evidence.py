"""Evidence acts only on the run's own nodes: bob's run posts through the real ingest endpoint
into a real store (SQLite and PostgreSQL), and control passes run as the daemon runs them
(observe, decide, act) against the recorded Slurm cluster.

The recorded running job (`show_job_running`) is root's (uid 0), tagged `slurmft-run:run-0001`,
and holds n[1-3]; bob's run is that run here. Alice's run has her agent on n4, a node bob's job
never held."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, text
from support.daemon_side import post_batch
from support.slurm_recordings import RecordedCluster, job_id_of, load_recording, recorded_jobs

from slurmft.controller import views as v
from slurmft.controller.act import Executor
from slurmft.controller.allocation import judge_allocation_reports
from slurmft.controller.decide import Policy, TrustPolicy, decide
from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.controller.observe import observe
from slurmft.db import Database
from slurmft.db.models import (
    Action,
    ActionKind,
    AllocationNode,
    Attempt,
    Event,
    EventKind,
    NodeRole,
)
from slurmft.db.records import denied_nodes
from slurmft.slurm.api import JobInfo
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.hostlist import expand
from slurmft.slurm.parse import parse_scontrol_line

BOB, ALICE = "run-0001", "ralice"
JOB = recorded_jobs()[0]  # bob's job: its id and start are the recording's, not written here
# scontrol's StartTime is the login node's local time (UTC on the recording machine).
JOB_STARTED = datetime.fromisoformat(
    parse_scontrol_line(load_recording("show_job_running").stdout)["StartTime"]
).astimezone(UTC)
# Drains are not held back by the partition's drained fraction (n3 drains in the recording).
POLICY = Policy(trust=TrustPolicy(max_drained_fraction=1.0))


class RecordedSlurm(CliSlurmClient):
    """The recorded cluster; scontrol's record of a job answers squeue's question about it too
    (no squeue of the running job alone was recorded), and drains and downs are kept, not sent."""

    def __init__(self) -> None:
        super().__init__(RecordedCluster(["show_job_running", "sinfo_nodes_drained"]))
        self.effects: list[tuple[str, str]] = []

    def jobs(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        return {job_id: self.job(job_id) for job_id in job_ids}

    def drain(self, node: str, reason: str) -> None:
        self.effects.append(("drain", node))

    def down(self, node: str, reason: str) -> None:
        self.effects.append(("down", node))


@pytest.fixture
def tokens(database: Database, seed_run: Callable[..., None]) -> dict[str, str]:
    out = {}
    for run_id, uid, job in ((BOB, 0, JOB), (ALICE, 1000, None)):
        token, digest = new_run_token()
        seed_run(database, run_id, job_id=job, owner_uid=uid, nodes=2, spares=1, token_hash=digest)
        out[run_id] = token
    return out


_SEQ: dict[str, int] = {}


def _post(
    server: IngestServer,
    token: str,
    run_id: str,
    node: str,
    *,
    events: Sequence[dict[str, Any]] = (),
    allocation: dict[str, Any] | None = None,
) -> tuple[int, dict[str, object]]:
    agent = f"{f'batch-step:{JOB}' if allocation else node}-{run_id}"
    _SEQ[agent] = _SEQ.get(agent, 0) + 1
    now = datetime.now(UTC).timestamp()
    batch: dict[str, Any] = {
        "v": 1,
        "run_id": run_id,
        "agent_id": agent,
        "node": node,
        "seq": _SEQ[agent],
        "sent_at": now,
        "events": [{"occurred_at": now, **e} for e in events],
    }
    if allocation is not None:
        batch["allocation"] = allocation
    return post_batch(server, json.dumps(batch).encode(), token)


def _fault(xid: int, action: str) -> dict[str, Any]:
    """A GPU fault as an agent reports it; ``action`` is the poster's word."""
    details = {"xid": xid, "gpu_index": 0, "action": action, "fault_kind": "xid"}
    return {"kind": "gpu_fault", "message": f"Xid {xid}", "details": details}


BOBS_ALLOCATION = {
    "job_id": JOB,
    "nodes": [
        {"node": "n1", "role": "active"},
        {"node": "n2", "role": "active"},
        {"node": "n3", "role": "spare"},
    ],
}


def _pass(database: Database, slurm: RecordedSlurm) -> list[v.Action]:
    """One control pass, as the daemon runs it."""
    with database.session() as s:
        view = observe(s, slurm, now=datetime.now(UTC))
    actions = decide(view, POLICY)
    Executor(database, slurm).execute(actions)
    return actions


def _acted_on(database: Database) -> list[tuple[ActionKind, str | None]]:
    with database.session() as s:
        return [
            (a.kind, a.node)
            for a in s.scalars(select(Action).order_by(Action.id))
            if a.kind in {ActionKind.AGENT_LEAVE, ActionKind.DRAIN_NODE, ActionKind.EVICT_NODE}
        ]


def _faults(database: Database) -> dict[str, bool | None]:
    with database.session() as s:
        rows = s.scalars(select(Event).where(Event.kind == EventKind.GPU_FAULT)).all()
        return {f"{e.node}:{e.xid}": e.foreign for e in rows}


def test_bobs_drain_class_fault_on_alices_node_is_stored_foreign_and_never_acted_on(
    database: Database, ingest_server: IngestServer, tokens: dict[str, str]
) -> None:
    slurm = RecordedSlurm()
    _post(ingest_server, tokens[BOB], BOB, "n1", allocation=BOBS_ALLOCATION)
    status, _ = _post(ingest_server, tokens[BOB], BOB, "n4", events=[_fault(79, "drain")])
    assert status == 200  # stored: evidence is kept, whoever it names
    _pass(database, slurm)
    _pass(database, slurm)
    assert slurm.effects == []
    assert _acted_on(database) == []
    with database.session() as s:
        assert denied_nodes(s) == set()
        assert denied_nodes(s, run_id=BOB) == set()
    # Alice's agent on n4 is not told to leave.
    status, reply = _post(ingest_server, tokens[ALICE], ALICE, "n4")
    assert (status, reply["commands"]) == (200, [])
    assert _faults(database) == {"n4:79": True}
    # Nor is it a failure of n4 in the failure history.
    with database.session() as s:
        for view in ("failures_by_node", "node_lemons"):
            assert s.execute(text(f"SELECT node FROM {view}")).all() == []


@pytest.mark.parametrize("xid", [13, 63])  # restart-class, record-class
def test_a_non_drain_xid_that_says_drain_does_not_drain_the_posters_own_node(
    database: Database, ingest_server: IngestServer, tokens: dict[str, str], xid: int
) -> None:
    slurm = RecordedSlurm()
    _post(ingest_server, tokens[BOB], BOB, "n1", allocation=BOBS_ALLOCATION)
    _post(ingest_server, tokens[BOB], BOB, "n2", events=[_fault(xid, "drain")])
    actions = _pass(database, slurm)
    assert slurm.effects == []
    assert _acted_on(database) == []
    restarts = [(type(a), a.node) for a in actions if isinstance(a, v.RestartWorkers)]
    # The table's word: Xid 13 restarts the application, Xid 63 is recorded only.
    assert restarts == ([(v.RestartWorkers, "n2")] if xid == 13 else [])
    assert _faults(database) == {f"n2:{xid}": False}


def test_evidence_before_the_allocation_is_held_then_judged(
    database: Database, ingest_server: IngestServer, tokens: dict[str, str]
) -> None:
    slurm = RecordedSlurm()
    faults = [_fault(79, "drain")]
    _post(ingest_server, tokens[BOB], BOB, "n2", events=faults)  # bob's own node
    _post(ingest_server, tokens[BOB], BOB, "n4", events=faults)  # alice's
    _pass(database, slurm)
    assert (slurm.effects, _acted_on(database)) == ([], [])  # held
    assert _faults(database) == {"n2:79": None, "n4:79": None}
    status, reply = _post(ingest_server, tokens[BOB], BOB, "n1", allocation=BOBS_ALLOCATION)
    assert (status, reply["commands"]) == (200, [])
    _pass(database, slurm)
    assert _faults(database) == {"n2:79": False, "n4:79": True}
    assert slurm.effects == [("drain", "n2")]
    assert _acted_on(database) == [(ActionKind.AGENT_LEAVE, "n2"), (ActionKind.DRAIN_NODE, "n2")]
    with database.session() as s:
        assert denied_nodes(s) == {"n2"}
        (row,) = s.scalars(select(Event).where(Event.kind == EventKind.ALLOCATION)).all()
        assert (row.foreign, row.details["allocation"]) == (False, ["n1", "n2", "n3"])


def test_evidence_from_before_the_job_started_is_foreign_even_on_nodes_the_job_then_got(
    database: Database, ingest_server: IngestServer, tokens: dict[str, str]
) -> None:
    """A run that waits in Slurm can post faults naming any node; when its job later starts on
    those nodes, the held faults must not read as its own (seen in the hostile-user test: bob's
    pending run's faults drained nodes his job got after alice's ended)."""
    slurm = RecordedSlurm()
    _post(ingest_server, tokens[BOB], BOB, "n2", events=[_fault(79, "drain")])
    # The fault came an hour before the recorded job started.
    with database.session() as s:
        (fault,) = s.scalars(select(Event).where(Event.kind == EventKind.GPU_FAULT)).all()
        fault.recorded_at = JOB_STARTED - timedelta(hours=1)
    _post(ingest_server, tokens[BOB], BOB, "n1", allocation=BOBS_ALLOCATION)
    _pass(database, slurm)
    assert _faults(database) == {"n2:79": True}
    assert (slurm.effects, _acted_on(database)) == ([], [])
    with database.session() as s:
        assert denied_nodes(s) == set() and denied_nodes(s, run_id=BOB) == set()
        (attempt,) = s.scalars(select(Attempt).where(Attempt.run_id == BOB)).all()
        assert attempt.started_at == JOB_STARTED


@pytest.mark.parametrize(
    ("run_id", "uid", "refused"),
    [
        ("rbob2", 0, f"job {JOB} is tagged with run run-0001, not run rbob2"),
        ("rbob3", 1000, f"job {JOB} belongs to uid 0, the run to uid 1000"),
    ],
)
def test_an_allocation_report_slurm_does_not_confirm_is_refused_and_recorded(  # noqa: PLR0917 (fixtures and parameters)
    database: Database,
    ingest_server: IngestServer,
    seed_run: Callable[..., None],
    run_id: str,
    uid: int,
    refused: str,
) -> None:
    """Bob's batch step reports alice's job (or one of another run) as its own: refused."""
    token, digest = new_run_token()
    seed_run(database, run_id, job_id=JOB, owner_uid=uid, nodes=2, token_hash=digest)
    slurm = RecordedSlurm()
    _post(ingest_server, token, run_id, "n1", allocation=BOBS_ALLOCATION)
    _post(ingest_server, token, run_id, "n2", events=[_fault(79, "drain")])
    _pass(database, slurm)
    assert (slurm.effects, _acted_on(database)) == ([], [])
    with database.session() as s:
        reports = s.scalars(
            select(Event).where(Event.kind == EventKind.ALLOCATION).order_by(Event.id)
        ).all()
        assert [(e.source, e.foreign) for e in reports] == [("agent", True), ("daemon", False)]
        assert reports[1].message == f"allocation report refused: {refused}"
        fault = s.scalars(select(Event).where(Event.kind == EventKind.GPU_FAULT)).one()
        assert fault.foreign is None  # held: the run's allocation is not known


def test_a_node_the_batch_step_no_longer_reports_leaves_the_allocation(
    database: Database, ingest_server: IngestServer, tokens: dict[str, str]
) -> None:
    """After a relaunch without n2 the allocation keeps n2's row with when and why it left;
    evidence about n2 that comes later is foreign (the node may be someone else's by now)."""
    slurm = RecordedSlurm()
    _post(ingest_server, tokens[BOB], BOB, "n1", allocation=BOBS_ALLOCATION)
    _pass(database, slurm)
    relaunched = {**BOBS_ALLOCATION, "nodes": [BOBS_ALLOCATION["nodes"][0], {"node": "n3"}]}
    _post(ingest_server, tokens[BOB], BOB, "n1", allocation=relaunched)
    _pass(database, slurm)
    _post(ingest_server, tokens[BOB], BOB, "n2", events=[_fault(79, "drain")])
    _pass(database, slurm)
    assert (slurm.effects, _acted_on(database)) == ([], [])
    with database.session() as s:
        rows = s.scalars(select(AllocationNode).order_by(AllocationNode.node)).all()
        left = {r.node: (r.role, r.left_at is not None) for r in rows}
        reports = s.scalars(
            select(Event.id).where(Event.kind == EventKind.ALLOCATION).order_by(Event.id)
        ).all()
        (gone,) = [r for r in rows if r.node == "n2"]
        assert gone.left_reason == f"not in the batch step's report {reports[1]}"
    assert left == {
        "n1": (NodeRole.ACTIVE, False),
        "n2": (NodeRole.ACTIVE, True),
        "n3": (NodeRole.ACTIVE, False),  # a spare that took n2's place trains now
    }
    assert _faults(database) == {"n2:79": True}


def test_a_checked_report_adopts_the_job_the_client_never_attached(
    database: Database, ingest_server: IngestServer, seed_run: Callable[..., None]
) -> None:
    """`slurmft submit` died between sbatch and attach_job: the run has no attempt. Its batch
    step's report, once Slurm confirms the job is the run's, opens the attempt with that job."""
    token, digest = new_run_token()
    seed_run(database, BOB, owner_uid=0, nodes=2, token_hash=digest, running=False)
    slurm = RecordedSlurm()
    _post(ingest_server, token, BOB, "n1", allocation=BOBS_ALLOCATION)
    _pass(database, slurm)
    with database.session() as s:
        (attempt,) = s.scalars(select(Attempt)).all()
        assert (attempt.number, attempt.slurm_job_id) == (1, JOB)
        assert sorted(n.node for n in attempt.nodes) == ["n1", "n2", "n3"]


def test_a_node_lost_before_the_report_was_judged_is_stored_from_the_jobs_step(
    database: Database, ingest_server: IngestServer, seed_run: Callable[..., None]
) -> None:
    """The daemon was down while the recorded job started and lost a node: Slurm's record of the
    job names two nodes, its step's record three. The late report's third node is stored (the
    next observation sees it lost); a node neither record names is left out."""
    recorded = load_recording("show_job_shrunk")
    job_id = job_id_of(recorded)
    token, digest = new_run_token()
    seed_run(database, "rec-shrunk", job_id=job_id, owner_uid=0, nodes=2, spares=1,
             token_hash=digest)  # fmt: skip
    steps = load_recording("squeue_steps_shrunk").stdout.splitlines()
    had = expand(next(line for line in steps if line.startswith(f"{job_id}.0|")).split("|")[1])
    claimed = [{"node": node, "role": "active"} for node in [*had, "n1"]]
    allocation = {"job_id": job_id, "nodes": claimed}
    _post(ingest_server, token, "rec-shrunk", had[0], allocation=allocation)
    runner = RecordedCluster(["show_job_shrunk", "squeue_steps_shrunk"])
    with database.session() as s:
        judge_allocation_reports(s, CliSlurmClient(runner), now=datetime.now(UTC))
        s.commit()
    with database.session() as s:
        stored = {r.node: r.left_at for r in s.scalars(select(AllocationNode))}
        (report,) = s.scalars(select(Event).where(Event.kind == EventKind.ALLOCATION)).all()
        assert (report.foreign, report.details["ignored"]) == (False, ["n1"])
    assert stored == dict.fromkeys(had)  # all three, none left yet
    assert [call[0] for call in runner.calls] == ["scontrol", "squeue"]
