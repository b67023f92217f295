"""Issue 46: no agent's evidence, whatever it holds, stops the control pass for anyone.

Hypothesis makes batches whose events are of every kind (and kinds that do not exist), with
arbitrary details: any JSON type at any key (the keys the daemon reads included), big and
out-of-range numbers, NaN, NUL characters, nesting past the bound, and bodies with bytes that
are not UTF-8. Each is posted through a real daemon's HTTP ingest endpoint, under the token of
root's run of the recorded running job (whose allocation, n[1-3], is known, so its evidence is
judged and gathered) from one of its nodes or a foreign one, or under bob's run (no job: its
evidence is held). Every `PASS_EVERY` batches, and at the end, the daemon's own control pass
runs (observe-only, so decide's actions are recorded, not sent to the recorded cluster).

Before each pass the test adds a bystander run whose Slurm job has completed: each pass must
end it. No pass may record a control error or hold a run: what passed the boundary never
raises later. SQLite and PostgreSQL, `EXAMPLES` batches each; derandomized, so every run of
the suite posts the same ones.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from support.daemon_side import daemon_config, post_batch
from support.slurm_recordings import RecordedJobs, recorded_jobs

from slurmft.controller.daemon import Daemon
from slurmft.controller.http import IngestServer
from slurmft.controller.ingest import new_run_token
from slurmft.core.kinds import EventKind, NodeRole
from slurmft.db import Database
from slurmft.db.models import AllocationNode, Attempt, Event, Run
from slurmft.db.states import RunState

EXAMPLES = int(os.environ.get("SLURMFT_EVIDENCE_EXAMPLES", "2000"))  # fewer only while developing
PASS_EVERY = 100
RUNNING, _, DONE = recorded_jobs()
ROOTS, BOB = "run-0001", "rbob"  # the recorded running job is root's, tagged run-0001
NODES = ("n1", "n2", "n3", "n4")  # n4: not in root's allocation

# The keys some part of the daemon reads, and the ones only it writes: where a hostile value
# would do harm if it got past the boundary.
READ_KEYS = (
    "step", "ordinal", "layout", "label", "path", "xid", "gpu_index", "fault_kind", "code",
    "detail", "action", "rdzv_round", "stacks", "stack_files", "peer", "silent_s", "job_id",
    "nodes", "role", "node", "key", "restart_key", "free", "agent_id", "goodput",
    "time_lost_counted_on", "allocation", "ignored", "refused", "report_event_id", "stage",
)  # fmt: skip
HUGE = (2**31, -(2**31), 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 10**30)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from(HUGE),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["\x00", "a\x00b", "[[", "n1", "1", "stop", "xid", "x" * 5000]),
)
keys = st.one_of(st.sampled_from(READ_KEYS), st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=12,
)
AGENT_KINDS = ["gpu_fault", "checkpoint", "hang", "restart", "collective_error", "peer_dead"]
kinds = st.one_of(
    st.sampled_from(AGENT_KINDS),
    st.sampled_from([k.value for k in EventKind]),
    st.sampled_from(["", "xid", 5]),
)
# Details of the right shape for some kind, often: so that much of it is accepted, judged
# and read by gather and decide, not only refused at the boundary.
plausible = st.dictionaries(
    st.sampled_from(
        ["step", "ordinal", "xid", "gpu_index", "fault_kind", "code", "detail", "action",
         "rdzv_round", "layout", "label", "peer", "silent_s", "other"]
    ),
    st.one_of(st.integers(0, 100), st.sampled_from(["stop", "xid", "slurmft", "n2", "1.0/2"])),
    max_size=4,
)  # fmt: skip
hostile = st.one_of(st.dictionaries(keys, values, max_size=6), values)
events = st.fixed_dictionaries(
    {"kind": kinds, "details": st.one_of(plausible, hostile)},
    optional={
        "message": st.one_of(st.text(max_size=30), scalars),
        "rank": st.one_of(st.integers(-2, 2**21), scalars),
        "fault_class": st.one_of(st.sampled_from(["hardware", "hang", "bogus"]), scalars),
    },
)
batches = st.fixed_dictionaries(
    {
        "run": st.sampled_from([ROOTS, ROOTS, BOB]),
        "node": st.sampled_from(NODES),
        "events": st.lists(events, min_size=1, max_size=3),
        "deep": st.integers(0, 40),  # nesting added to the first event's details
        "garble": st.booleans(),  # a byte that is not UTF-8, inside a string
    }
)


@pytest.fixture
def setting(
    database: Database, seed_run: Callable[..., None], tmp_path: Path
) -> tuple[Daemon, dict[str, str]]:
    tokens = {}
    for run_id, uid, job in ((ROOTS, 0, RUNNING), (BOB, 1001, None)):
        token, digest = new_run_token()
        seed_run(database, run_id, job_id=job, owner_uid=uid, running=job is not None,
                 token_hash=digest)  # fmt: skip
        tokens[run_id] = token
    with database.session() as s:
        attempt = s.scalars(select(Attempt).where(Attempt.run_id == ROOTS)).one()
        joined = attempt.submitted_at
        for node in ("n1", "n2", "n3"):
            role = NodeRole.SPARE if node == "n3" else NodeRole.ACTIVE
            attempt.nodes.append(AllocationNode(node=node, role=role, joined_at=joined))
    config = daemon_config(tmp_path, "daemon.observe_only=true")
    return Daemon(config, database=database, slurm=RecordedJobs()), tokens


def _body(drawn: dict[str, Any], seq: int) -> bytes:
    now = time.time()
    items = [{"occurred_at": now, **event} for event in drawn["events"]]
    details: Any = items[0]["details"]
    for _ in range(drawn["deep"]):
        details = {"d": details}
    items[0]["details"] = details
    batch = {
        "v": 1, "run_id": drawn["run"], "agent_id": f"{drawn['node']}-agent",
        "node": drawn["node"], "seq": seq, "sent_at": now, "events": items,
    }  # fmt: skip
    body = json.dumps(batch, allow_nan=True).encode()
    if drawn["garble"]:
        body = body.replace(b'"kind"', b'"ki\xffnd"', 1)
    return body


class Passes:
    """The control passes and their bystanders."""

    def __init__(self, database: Database, daemon: Daemon, seed_run: Callable[..., None]):
        self.database, self.daemon, self.seed_run = database, daemon, seed_run
        self.posted = 0
        self.statuses: dict[int, int] = {}
        self.done = 0

    def run_one(self) -> None:
        bystander = f"by-{self.done}"
        self.seed_run(self.database, bystander, job_id=DONE, owner_uid=1000)
        self.daemon.control_pass()
        self.done += 1
        assert self.daemon.skipped_because is None
        with self.database.session() as s:
            ended = s.get(Run, bystander)
            assert ended is not None and ended.state is RunState.COMPLETED
            errors = s.scalars(select(Event).where(Event.kind == EventKind.CONTROL_ERROR)).all()
            assert [e.message for e in errors] == []
            assert s.scalar(select(func.max(Run.control_failures))) == 0


def test_no_evidence_stops_a_control_pass(
    database: Database,
    ingest_server: IngestServer,
    setting: tuple[Daemon, dict[str, str]],
    seed_run: Callable[..., None],
) -> None:
    daemon, tokens = setting
    passes = Passes(database, daemon, seed_run)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(drawn=batches)
    def post(drawn: dict[str, Any]) -> None:
        passes.posted += 1
        status, _ = post_batch(
            ingest_server, _body(drawn, passes.posted), tokens[drawn["run"]]
        )
        assert status < 500
        passes.statuses[status] = passes.statuses.get(status, 0) + 1
        if passes.posted % PASS_EVERY == 0:
            passes.run_one()

    post()
    passes.run_one()
    print(f"statuses: {sorted(passes.statuses.items())}, passes: {passes.done}")
    assert passes.posted >= EXAMPLES
    assert passes.statuses.get(200, 0) > EXAMPLES // 20  # not all refused: some were judged
    with database.session() as s:
        judged = s.scalar(
            select(func.count()).select_from(Event).where(
                Event.run_id == ROOTS, Event.source == "agent", Event.foreign.is_(False)
            )
        )
    assert judged and judged > 0  # hostile evidence reached gather and decide
