"""One user against another on the real daemon and the local cluster (issue 14, done-when; and
issue 46's attacks: the poisoned allocation event, the hostile job name, the injected loss).

slurmft-alice trains a real run under a root daemon. slurmft-bob, with a run of his own that
waits in Slurm, tries one attack after another on her run through everything he can reach:
the CLI socket (cancel, attach her job, read her run), the agents' endpoint with his run's
token (an allocation claiming her job, GPU faults, hangs and stragglers naming her nodes, her
run's id, impossible values, a flood of events, idle connections held open, an `allocation`
event, a kind only the daemon records, whose details once crashed every control pass for good)
and his own waiting job's name and comment in Slurm (scontrol's `Key=value` text naming her node
as COMPLETED, then a newline and a forged squeue row of her job), which the daemon reads every
pass with her job.

Alice's run must not notice: her `slurmft status` moves on pass after pass, every pass completes
(no control error, no run held), the daemon reads her job as running and bob's as waiting. While
all of it is in Slurm and the store, one of her nodes is lost for real: its loss is recorded and
the node taken out of her run, a spare trains in its place, and the run completes. No action on
her run but that loss's and her job's own end, her job never requeued (Restarts=0) and its
excluded nodes unchanged, none of her nodes drained, only the lost one denylisted (for her run).
Bob drains and denylists nothing, anywhere.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from daemon_process import DaemonProcess, free_port, run_slurmft, running_daemon, slurmft
from e2e_run import EXAMPLE, SubmittedRun, submit
from local_cluster import Cluster
from sqlalchemy import select
from support.waiting import wait_for_value
from unix_users import TestUsers, UnixUser

from slurmft.db.models import Action, ActionKind, ActionStatus, Attempt, Event, EventKind, Run
from slurmft.db.records import denied_nodes
from slurmft.db.states import AttemptState, RunState
from slurmft.protocol import BATCH_PATH
from slurmft.slurm.api import JobState

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.users]

# What only a job's own end may do to a run; anything else on alice's run but the injected
# loss's own action (the lost node taken out of it) came from bob.
HER_OWN = {ActionKind.FINISH_RUN}
ON_NODES = {ActionKind.DRAIN_NODE, ActionKind.AGENT_LEAVE, ActionKind.EVICT_NODE}
# Alice's run trains long enough to see the attacks, the loss and the spare's takeover.
STEPS = 240


@pytest.fixture
def root_daemon(tmp_path: Path, open_dir: Path) -> Iterator[DaemonProcess]:
    with ExitStack() as stack:
        yield stack.enter_context(
            running_daemon(
                tmp_path,
                SLURMFT_PATHS_RUNTIME_DIR=str(open_dir / "run"),
                SLURMFT_DAEMON_METRICS_LISTEN=f"127.0.0.1:{free_port()}",  # passes counted
            )
        )


class Ingest:
    """The daemon's agents' endpoint, as anyone holding a token reaches it."""

    def __init__(self, daemon: DaemonProcess) -> None:
        host, port = daemon.env["SLURMFT_DAEMON_INGEST_LISTEN"].rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.seq = 0

    def post(self, token: str, body: bytes, headers: dict[str, str] | None = None) -> int:
        return self.answer(token, body, headers)[0]

    def answer(
        self, token: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """The status and the body of the daemon's answer."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(
                "POST",
                BATCH_PATH,
                body=body,
                headers={
                    "Authorization": f"Bearer {token}",
                    "Content-Type": "application/json",
                    **(headers or {}),
                },
            )
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def batch(
        self, token: str, run_id: str, node: str, raw: dict[str, str] | None = None, **fields: Any
    ) -> int:
        """A batch of ``fields``; ``raw`` replaces JSON text in the body as it is written."""
        return self.batch_answer(token, run_id, node, raw, **fields)[0]

    def batch_answer(
        self, token: str, run_id: str, node: str, raw: dict[str, str] | None = None, **fields: Any
    ) -> tuple[int, bytes]:
        self.seq += 1
        now = time.time()
        body = {
            "v": 1,
            "run_id": run_id,
            "agent_id": fields.pop("agent_id", f"bob-on-{node}"),
            "node": node,
            "seq": fields.pop("seq", self.seq),
            "sent_at": now,
            **fields,
        }
        text = json.dumps(body)
        for placeholder, replacement in (raw or {}).items():
            text = text.replace(placeholder, replacement)
        return self.answer(token, text.encode())


def _fault(xid: int, now: float, action: str = "drain") -> dict[str, Any]:
    details = {"xid": xid, "gpu_index": 0, "action": action, "fault_kind": "xid"}
    return {"kind": "gpu_fault", "occurred_at": now, "message": f"Xid {xid}", "details": details}


def _token(run_home: Path) -> str:
    return (run_home / "ckpt" / ".slurmft" / "token").read_text().strip()


def _bobs_waiting_run(
    cluster: Cluster, daemon: DaemonProcess, home: Path, bob: UnixUser
) -> tuple[str, str]:
    """A run of bob's whose job waits: it wants every node to itself while alice's job holds
    some (`--exclusive`: sbatch's input variables such as SBATCH_EXCLUSIVE no longer reach it,
    as a resubmission could not repeat them)."""
    every = str(len(cluster.client.nodes()))
    argv = ["submit", "--nodes", every, "--spares", "0", "--ckpt-dir", str(home / "ckpt")]
    done = run_slurmft(
        daemon.client_env(),
        *argv,
        "--exclusive",
        "--json",
        "--",
        "train.py",
        as_user=bob,
    )
    assert done.returncode == 0, done.stderr
    submitted = json.loads(done.stdout)
    cluster._jobs.append(submitted["job_id"])
    return str(submitted["run_id"]), str(submitted["job_id"])


def _attack_through_the_socket(
    daemon: DaemonProcess, bob: UnixUser, alice_run: SubmittedRun, bobs: str
) -> None:
    env = daemon.client_env()
    for argv in (("cancel", alice_run.run_id), ("status", alice_run.run_id)):
        done = run_slurmft(env, *argv, as_user=bob)
        assert done.returncode != 0 and "visible to you" in done.stderr, done.stdout
    attach = (
        "import sys\n"
        "from slurmft.controller.rpc import RpcError, call\n"
        "try:\n"
        f"    call(sys.argv[1], 'attach_job', run_id={bobs!r}, job_id={alice_run.job_id!r})\n"
        "except RpcError as e:\n"
        "    print('refused:', e)\n"
    )
    done = bob.run([str(bob.bin_dir / "python"), "-c", attach, str(daemon.socket_path)], env)
    assert done.stdout.startswith("refused:") and "belongs to uid" in done.stdout, done


def _attack_through_ingest(
    ingest: Ingest, token: str, bobs: str, alice_run: SubmittedRun, nodes: list[str]
) -> list[int]:
    """Every answer bob got; none of it may reach alice's run."""
    now = time.time()
    answers = []
    # Her job and her nodes, claimed as his allocation: Slurm says the job is alice's.
    claim = {"job_id": alice_run.job_id, "nodes": [{"node": n, "role": "active"} for n in nodes]}
    answers.append(ingest.batch(token, bobs, nodes[0], agent_id="batch-step:x", allocation=claim))
    for node in nodes:
        events = [
            _fault(79, now),  # fallen off the bus: a drain, if it were his node
            _fault(48, now),  # double-bit ECC
            {"kind": "hang", "occurred_at": now, "message": "rank 0 hung", "rank": 0},
            {"kind": "straggler", "occurred_at": now, "message": f"{node} slow", "rank": 1},
        ]
        beats = [
            {
                "rank": rank,
                "local_rank": 0,
                "phase": "step",
                "step": 1,
                "progress_age_s": 3600.0,
                "deadline_s": 1.0,
                "overdue": True,
                "sent_at": now,
            }
            for rank in range(3)
        ]
        answers.append(ingest.batch(token, bobs, node, events=events, heartbeats=beats))
    # Her run's id under his token.
    answers.append(ingest.batch(token, alice_run.run_id, nodes[0], events=[_fault(79, now)]))
    # Impossible values, and a flood of events in one batch.
    answers.append(ingest.batch(token, bobs, nodes[0], events=[_fault(79, 1e20)]))
    answers.append(ingest.batch(token, bobs, nodes[0], seq=2**63))
    # Details nested 5,000 deep (written out: json.dumps itself stops at ~1,000).
    deep = '{"d":' * 5000 + "{}" + "}" * 5000
    answers.append(
        ingest.batch(
            token,
            bobs,
            nodes[0],
            events=[{**_fault(79, now), "details": "DEEP"}],
            raw={'"DEEP"': deep},
        )
    )
    answers.append(
        ingest.batch(token, bobs, nodes[0], events=[{**_fault(79, now), "message": "a\x00b"}])
    )
    answers.append(ingest.batch(token, bobs, nodes[0], events=[_fault(79, now)] * 20000))
    answers.append(ingest.post(token, b"{}", {"Content-Length": "²"}))
    return answers


def _poisoned_allocation(
    ingest: Ingest, token: str, bobs: str, alice_run: SubmittedRun, node: str
) -> None:
    """An `allocation` event, a kind only the daemon records, with details of the wrong shape
    (once stored, every control pass crashed on them, for every user): refused, naming it."""
    for job_id in ("1", alice_run.job_id):
        event = {"kind": "allocation", "occurred_at": time.time(),
                 "details": {"job_id": job_id, "nodes": 5}}  # fmt: skip
        status, body = ingest.batch_answer(token, bobs, node, events=[event])
        assert status == 422, (status, body)
        (refused,) = json.loads(body)["refused"]
        assert (refused["items"], refused["index"]) == ("events", 0), refused
        assert "'allocation' is recorded by the daemon only" in refused["reason"], refused


def _rename(bob: UnixUser, env: dict[str, str], job_id: str, **fields: str) -> None:
    """Bob's update of his own job: Slurm lets a user set its name and comment to any text."""
    argv = ["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())]
    done = bob.run(argv, env)
    assert done.returncode == 0, done.stderr


class Passes:
    """The daemon's control passes, counted by outcome on its /metrics."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.url = f"http://{daemon.env['SLURMFT_DAEMON_METRICS_LISTEN']}/metrics"

    def count(self, outcome: str) -> int:
        with urllib.request.urlopen(self.url, timeout=10) as reply:
            text = reply.read().decode()
        line = rf'^slurmft_control_passes_total{{outcome="{outcome}"}} (\S+)$'
        match = re.search(line, text, re.MULTILINE)
        return int(float(match.group(1))) if match else 0


def _read(run: SubmittedRun, run_id: str) -> tuple[RunState, Any, str | None, int]:
    """How the daemon reads a run's job (its latest attempt's state and nodes), and the run's
    failed passes in a row."""
    with run.database.session() as s:
        row = s.get(Run, run_id)
        assert row is not None
        attempt = s.scalars(
            select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number.desc())
        ).first()
        assert attempt is not None
        return row.state, attempt.state, attempt.nodelist, row.control_failures


def _status_every_pass(
    daemon: DaemonProcess, alice: UnixUser, run: SubmittedRun, passes: Passes, count: int
) -> list[tuple[int, dict[str, Any]]]:
    """Alice's `slurmft status` after each of ``count`` completed control passes: (the passes
    completed so far, what she sees)."""
    seen = []
    done = passes.count("completed")
    for _ in range(count):
        done, _ = wait_for_value(
            "a control pass to complete",
            lambda: passes.count("completed"),
            lambda n, after=done: n > after,
            timeout_s=30,
        )
        status = slurmft(daemon.client_env(), "status", run.run_id, "--json", as_user=alice)
        seen.append((done, json.loads(status)))
    return seen


@contextlib.contextmanager
def _idle_connections(ingest: Ingest, count: int) -> Iterator[None]:
    held = []
    try:
        for _ in range(count):
            held.append(socket.create_connection((ingest.host, ingest.port), timeout=5))
        yield
    finally:
        for conn in held:
            conn.close()


def _actions(run: SubmittedRun, run_id: str) -> list[tuple[ActionKind, str | None, str]]:
    with run.database.session() as s:
        rows = s.scalars(select(Action).where(Action.run_id == run_id).order_by(Action.id))
        return [(a.kind, a.node, a.reason) for a in rows]


def test_bobs_attacks_on_alices_run_change_nothing_for_her(
    open_dir: Path, cluster: Cluster, root_daemon: DaemonProcess, test_users: TestUsers
) -> None:
    alice, bob = test_users.alice, test_users.bob
    daemon = root_daemon
    steps = STEPS
    script = [*EXAMPLE, "--steps", str(steps)]  # the last --steps counts
    run = submit(
        cluster, daemon, alice.own(open_dir / "alice"), script, name="alice", as_user=alice
    )  # 3 nodes and a spare
    run.wait_training(past_step=5)
    job = cluster.client.job(run.job_id)
    her_nodes = sorted(job.nodes)
    for node in her_nodes:
        cluster.resume_after(node)  # should bob get one drained, the next test still has it
    excluded_before = job.raw.get("ExcNodeList")
    # The node lost during the attacks: one that trains, not the batch host (whose loss ends the
    # job's step for all); bob's text names another of hers.
    victim = sorted(set(run.beating_nodes().values()) - {job.batch_host})[0]
    named = job.batch_host
    assert named is not None and named != victim
    bob_home = bob.own(open_dir / "bob")
    bobs, bobs_job = _bobs_waiting_run(cluster, daemon, bob_home, bob)
    passes = Passes(daemon)
    try:
        _attack_through_the_socket(daemon, bob, run, bobs)
        ingest = Ingest(daemon)
        with _idle_connections(ingest, 100):
            answers = _attack_through_ingest(ingest, _token(bob_home), bobs, run, her_nodes)
            # Stored as evidence (200), or refused with a 4xx: never a 5xx retried for ever.
            assert all(status == 200 or 400 <= status < 500 for status in answers), answers
            assert daemon.proc is not None and daemon.proc.poll() is None
            # A few passes with all of it in the store, while her run goes on.
            step_before = run.latest_step()
            wait_for_value(
                "alice's run to train on through bob's attacks",
                run.latest_step,
                lambda step: step >= min(step_before + 3, steps),
                timeout_s=120,
            )
        _poisoned_allocation(ingest, _token(bob_home), bobs, run, her_nodes[0])

        # Bob's job, read by the daemon every pass with hers (squeue, scontrol where needed),
        # named and commented with scontrol's text (the comment still tags his run), then with a
        # squeue row of her job, COMPLETED on one node.
        her_read, bobs_read = _read(run, run.run_id), _read(run, bobs)
        assert her_read[:2] == (RunState.RUNNING, AttemptState.RUNNING), her_read
        assert bobs_read[1] is AttemptState.SUBMITTED and not bobs_read[2], bobs_read
        key_values = f"x JobState=COMPLETED NodeList={named} Restarts=x"
        _rename(bob, daemon.client_env(), bobs_job, JobName=key_values,
                Comment=f"slurmft-run:{bobs} {key_values}")  # fmt: skip
        seen = _status_every_pass(daemon, alice, run, passes, 4)
        row = f"{run.job_id}|COMPLETED|None|{named}|{named}|slurmft-run:{run.run_id}|z"
        _rename(bob, daemon.client_env(), bobs_job, JobName=f"y\n{row}")
        record = cluster.client.job(bobs_job)
        assert (record.name, record.state) == (f"y\n{row}", JobState.PENDING), record
        for _ in range(2):
            seen += _status_every_pass(daemon, alice, run, passes, 2)
            assert _read(run, run.run_id) == her_read  # running, on her four nodes
            assert _read(run, bobs) == bobs_read  # waiting
        # Her job twice in squeue's output: both jobs were read alone, from scontrol's records
        # (bob's over two lines, his comment's Key= text in it).
        assert "squeue's rows cannot be told apart" in daemon.log.read_text()
        # Her status moves on, pass after pass, each pass completed and none of hers failed.
        print(f"\nalice's step after passes {[(n, st['step']) for n, st in seen]}")
        steps_seen = [status["step"] for _, status in seen]
        assert steps_seen == sorted(steps_seen) and steps_seen[-1] > steps_seen[0], seen
        for _, status in seen:
            assert (status["state"], status["control_failures"], status["held"]) == (
                "running", 0, False,
            ), status  # fmt: skip
        assert passes.count("error") == 0

        # A real loss of one of her nodes, while all of it is in Slurm and the store.
        assert run.latest_step() < steps - 20, "the loss must land while she trains"
        cluster.kill_node(victim)  # revived by the fixture
        wait_for_value(
            f"the daemon to record the loss of {victim}",
            lambda: {e.node for e in run.events(Event.kind == EventKind.NODE_LOST)},
            lambda nodes: victim in nodes,
            timeout_s=90,
        )
        wait_for_value(
            f"{victim} taken out of her run",
            lambda: run.actions(Action.kind == ActionKind.AGENT_LEAVE),
            lambda leaves: any(a.status is ActionStatus.DONE for a in leaves),
            timeout_s=60,
        )
        run.wait_replaced(victim)
        seen = _status_every_pass(daemon, alice, run, passes, 3)
        assert all(status["control_failures"] == 0 for _, status in seen), seen
        assert _read(run, bobs) == bobs_read
    finally:
        # Bob ends his own run before alice's job frees the nodes his waits for: his job must
        # never start (it would hold her nodes, and the test would be about something else).
        run_slurmft(daemon.client_env(), "cancel", bobs, as_user=bob)
    run.wait_completed(steps)
    wait_for_value(
        "the daemon to record alice's run completed",
        lambda: run.run().state,
        lambda state: state is RunState.COMPLETED,
        timeout_s=60,
    )

    ours = _actions(run, run.run_id)
    # Her job's end, and her lost node taken out of her run: nothing else.
    assert {(kind, node) for kind, node, _ in ours if kind not in HER_OWN} == {
        (ActionKind.AGENT_LEAVE, victim)
    }, ours
    record = cluster.client.job(run.job_id)
    assert record.raw.get("Restarts") == "0", record.raw  # the spare, not a requeue
    assert record.raw.get("ExcNodeList") == excluded_before
    assert passes.count("error") == 0
    with run.database.session() as s:
        assert denied_nodes(s) == set()  # nothing kept out for everyone
        assert denied_nodes(s, run_id=run.run_id) == {victim}  # the loss's: for her run only
        assert denied_nodes(s, run_id=bobs) == set()
        on_nodes = s.scalars(select(Action).where(Action.kind.in_(ON_NODES))).all()
        assert {(a.kind, a.node, a.run_id) for a in on_nodes} == {
            (ActionKind.AGENT_LEAVE, victim, run.run_id)
        }, [(a.kind, a.node, a.reason) for a in on_nodes]
        lost = s.scalars(select(Event).where(Event.kind == EventKind.NODE_LOST)).all()
        assert {(e.run_id, e.node) for e in lost} == {(run.run_id, victim)}
        errors = s.scalars(select(Event).where(Event.kind == EventKind.CONTROL_ERROR)).all()
        assert errors == [], [(e.run_id, e.message) for e in errors]
        for run_id in (run.run_id, bobs):
            row = s.get(Run, run_id)
            assert row is not None and row.control_failures == 0, row
        assert not s.scalars(select(Action).where(Action.kind == ActionKind.HOLD_RUN)).all()
        # Bob's evidence is kept (it is his run's history) and judged foreign: he had no node.
        judged = s.scalars(
            select(Event.foreign).where(Event.run_id == bobs, Event.kind == EventKind.GPU_FAULT)
        ).all()
        assert judged and all(foreign is not False for foreign in judged), judged
    for node in her_nodes:
        assert not cluster.client.node(node).status.drain_requested, node
    assert cluster.client.job(run.job_id).state is JobState.COMPLETED
    run.database.dispose()
