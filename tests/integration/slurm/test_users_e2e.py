"""Real users on the real daemon and the local Slurm cluster.

- Scoping: slurmft-alice submits a run with `slurmft submit` (its job runs as her), slurmft-bob
  one that waits in Slurm; bob's `slurmft runs | status | events | cancel` neither show nor
  touch alice's; alice sees and cancels her own; root sees everyone's. The daemon runs as root
  under the service's umask (0027) and its socket is still reachable by every user.
- Without Slurm privileges: a daemon run by bob (a per-user daemon supervising bob's own run; bob
  is neither root, SlurmUser nor an Operator) decides to drain a node after an Xid 79. Slurm
  refuses; the daemon records `skipped` with "drain requested, not permitted", keeps running,
  takes the node out of the run (the agent leaves, a spare takes over) and the run completes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, run_slurmft, running_daemon, slurmft
from e2e_run import EXAMPLE, SubmittedRun, submit
from local_cluster import Cluster
from support.waiting import wait_for_value
from unix_users import TestUsers, UnixUser

from slurmft.controller.rpc import RpcServer, call
from slurmft.db.models import Action, ActionKind, ActionStatus
from slurmft.db.records import denied_nodes
from slurmft.db.states import RunState
from slurmft.slurm.api import JobState

pytestmark = pytest.mark.users


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def root_daemon(tmp_path: Path, open_dir: Path) -> Iterator[DaemonProcess]:
    """The daemon as root, its store private, its socket where users look for it. Started under
    the service's UMask=0027: the socket's directory it creates must still be reachable."""
    with ExitStack() as stack:
        with umask(0o027):
            daemon = stack.enter_context(
                running_daemon(tmp_path, SLURMFT_PATHS_RUNTIME_DIR=str(open_dir / "run"))
            )
        yield daemon


def _cli_json(
    daemon: DaemonProcess, user: UnixUser, *argv: str, env: dict[str, str] | None = None
) -> object:
    """`slurmft ARGV --json` as ``user`` (``--json`` goes before a `--`)."""
    at = argv.index("--") if "--" in argv else len(argv)
    argv = (*argv[:at], "--json", *argv[at:])
    done = run_slurmft(daemon.client_env() | (env or {}), *argv, as_user=user)
    assert done.returncode == 0, f"{user.name}: slurmft {' '.join(argv)}: {done.stderr}"
    return json.loads(done.stdout)


def _run_ids(rows: object) -> list[str]:
    assert isinstance(rows, list)
    return sorted(row["run_id"] for row in rows)


def _pending_run(
    cluster: Cluster, daemon: DaemonProcess, home: Path, user: UnixUser
) -> tuple[str, str]:
    """A run of ``user`` whose job waits: it wants every node to itself (`--exclusive`) while
    another job holds some. The caller cancels it before they free up."""
    every = str(len(cluster.client.nodes()))
    submitted = _cli_json(
        daemon,
        user,
        "submit",
        *("--nodes", every, "--spares", "0", "--exclusive", "--ckpt-dir", str(home / "ckpt")),
        *("--", "train.py"),
    )
    assert isinstance(submitted, dict)
    cluster._jobs.append(submitted["job_id"])
    assert cluster.client.job(submitted["job_id"]).state is JobState.PENDING
    return submitted["run_id"], submitted["job_id"]


@pytest.mark.slurm
@pytest.mark.torch
def test_users_see_and_cancel_only_their_own_runs(
    open_dir: Path, cluster: Cluster, root_daemon: DaemonProcess, test_users: TestUsers
) -> None:
    alice, bob = test_users.alice, test_users.bob
    daemon = root_daemon
    assert (open_dir / "run").stat().st_mode & 0o777 == 0o755
    endless = [*EXAMPLE, "--steps", "100000"]  # it trains until cancelled
    run = submit(
        cluster, daemon, alice.own(open_dir / "alice"), endless, name="alice-run", as_user=alice
    )
    run.wait_training()
    assert cluster.client.job(run.job_id).raw.get("UserId", "").startswith(alice.name)
    bobs, bobs_job = _pending_run(cluster, daemon, bob.own(open_dir / "bob"), bob)

    assert _run_ids(_cli_json(daemon, bob, "runs")) == [bobs]
    for op in ("status", "events", "cancel"):
        done = run_slurmft(daemon.client_env(), op, run.run_id, as_user=bob)
        assert done.returncode == 1, done.stdout
        assert f"no run {run.run_id} visible to you" in done.stderr
    assert run.run().cancel_requested_at is None
    assert cluster.client.job(run.job_id).state is JobState.RUNNING

    assert _run_ids(_cli_json(daemon, alice, "runs")) == [run.run_id]
    status = _cli_json(daemon, alice, "status", run.run_id)
    assert isinstance(status, dict)
    assert (status["owner"], status["state"], status["job_id"]) == (
        alice.name,
        "running",
        run.job_id,
    )
    assert "entries" in _cli_json(daemon, alice, "events", run.run_id)  # type: ignore[operator]
    refused = run_slurmft(daemon.client_env(), "runs", "--user", alice.name, as_user=bob)
    assert refused.returncode == 1 and "only an admin may list" in refused.stderr
    root_sees = json.loads(slurmft(daemon.env, "runs", "--json"))
    assert _run_ids(root_sees) == sorted([run.run_id, bobs])
    # Bob ends his own run before alice's job frees the nodes it waits for (through slurmft: a
    # job cancelled behind the daemon's back looks preempted, and the daemon would resubmit it).
    assert run_slurmft(daemon.client_env(), "cancel", bobs, as_user=bob).returncode == 0
    wait_for_value(
        "bob's job to be cancelled",
        lambda: cluster.client.job(bobs_job).state,
        lambda state: state is JobState.CANCELLED,
    )

    cancelled = run_slurmft(daemon.client_env(), "cancel", run.run_id, as_user=alice)
    assert cancelled.returncode == 0, cancelled.stderr
    wait_for_value(
        "the daemon to end alice's run", lambda: run.run().state, RunState.CANCELLED.__eq__
    )
    wait_for_value(
        "alice's job to end",
        lambda: cluster.client.job(run.job_id).state,
        lambda state: not state.holds_nodes,
    )
    run.database.dispose()


def _uid_of(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def _drain_of(run: SubmittedRun, node: str) -> Action | None:
    found = run.actions(Action.kind == ActionKind.DRAIN_NODE, Action.node == node)
    return found[0] if found and found[0].status is not ActionStatus.PLANNED else None


@pytest.mark.slurm
@pytest.mark.torch
def test_a_daemon_without_slurm_privileges_records_drain_requested_and_goes_on(
    open_dir: Path, cluster: Cluster, test_users: TestUsers
) -> None:
    bob = test_users.bob
    home = bob.own(open_dir / "bob")
    with running_daemon(home, as_user=bob) as daemon:
        assert _uid_of(daemon) == bob.uid
        inject = home / "gpu-faults"
        inject.write_text("")
        env = {"SLURMFT_GPU_INJECT": str(inject), "SLURMFT_GPU_POLL_INTERVAL_S": "1"}
        run = submit(cluster, daemon, home, EXAMPLE, name="bob-xid79", env=env, as_user=bob)
        run.wait_training()
        batch_host = cluster.client.job(run.job_id).batch_host
        victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
        cluster._drained.add(victim)  # resumed by the fixture should the drain get through
        inject.write_text(f"xid=79,gpu=3,node={victim}\n")

        drain, _ = wait_for_value(
            "the daemon's drain decision", lambda: _drain_of(run, victim), bool, timeout_s=60
        )
        assert drain is not None and drain.status is ActionStatus.SKIPPED
        assert drain.error is not None
        assert drain.error.startswith("drain requested, not permitted"), drain.error
        assert not cluster.client.node(victim).status.drain_requested  # Slurm refused it

        run.wait_replaced(victim)
        (leave,) = run.actions(Action.kind == ActionKind.AGENT_LEAVE, Action.node == victim)
        assert leave.reason.startswith("slurmft: Xid 79")
        with run.database.session() as s:
            assert victim in denied_nodes(s, run_id=run.run_id)
        status = call(daemon.socket_path, "status", run_id=run.run_id)
        assert victim in status["excluded_nodes"]
        wait_for_value(
            "the run to complete",
            lambda: run.jsonl("losses.jsonl"),
            lambda records: any(r["step"] == 60 for r in records),
            timeout_s=240,
        )
        assert {r["world_size"] for r in run.jsonl("losses.jsonl")} == {3}
        assert daemon.proc is not None and daemon.proc.poll() is None  # still running
        run.database.dispose()


def test_a_socket_the_user_cannot_reach_is_a_clear_error(
    test_users: TestUsers, open_dir: Path
) -> None:
    private = open_dir / "private"
    private.mkdir(mode=0o700)
    server = RpcServer(private / "slurmft.sock", {"runs": lambda uid, args: []}).start()
    try:
        env = {"SLURMFT_PATHS_RUNTIME_DIR": str(private)}
        done = run_slurmft(env, "runs", as_user=test_users.bob)
    finally:
        server.stop()
    assert done.returncode == 1
    assert "permission denied on the slurmft daemon's socket" in done.stderr, done.stderr
