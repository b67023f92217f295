"""The CLI ↔ daemon socket: the caller's uid comes from the kernel, and scopes what it sees."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.slurm_recordings import RecordedCluster, recorded_jobs

from slurmft.controller.admins import Admins
from slurmft.controller.rpc import DaemonUnreachable, RpcError, RpcServer, call
from slurmft.controller.user_ops import operations
from slurmft.db import Database
from slurmft.db.models import Attempt, Event, EventKind, Run
from slurmft.slurm.cli_backend import CliSlurmClient

ALICE, BOB = 15001, 15002


@pytest.fixture
def socket_path(database: Database, seed_run: Callable[..., None]) -> Iterator[Path]:
    for run_id, uid, name in (("ra", ALICE, "alice"), ("rb", BOB, "bob")):
        seed_run(
            database, run_id, job_id=f"{uid}", owner_uid=uid, owner_name=name, name=f"{name}-run"
        )
    with database.session() as s:
        for run_id in ("ra", "rb"):
            s.add(Event(run_id=run_id, kind=EventKind.NODE_LOST, node="n2", message="lost n2"))
    # Other uids must reach the socket: pytest's own tmp dirs are private to root.
    runtime = Path(tempfile.mkdtemp(prefix="slurmft-rpc-"))
    runtime.chmod(0o755)
    slurm = CliSlurmClient(RecordedCluster(["show_job_running", "show_job_unknown"]))
    server = RpcServer(runtime / "slurmft.sock", operations(database, slurm=slurm)).start()
    try:
        yield server.path
    finally:
        server.stop()
        shutil.rmtree(runtime, ignore_errors=True)


def _call_as(uid: int, path: Path, op: str, **args: Any) -> dict[str, Any]:
    """Run `call` in a child process that has dropped to ``uid``; return its result or error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop privileges, ask, report, exit without running pytest's cleanup
        os.close(read_end)
        try:
            os.setgid(uid)
            os.setuid(uid)
            out: dict[str, Any] = {"result": call(path, op, **args)}
        except (RpcError, DaemonUnreachable) as exc:
            out = {"error": str(exc)}
        except BaseException as exc:  # report anything to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write_end, json.dumps(out).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to other uids needs root")


def test_each_user_sees_only_their_own_runs(socket_path: Path) -> None:
    alice = _call_as(ALICE, socket_path, "runs")["result"]
    assert [r["run_id"] for r in alice] == ["ra"]
    assert alice[0]["job_id"] == str(ALICE) and alice[0]["state"] == "running"
    assert [r["run_id"] for r in _call_as(BOB, socket_path, "runs")["result"]] == ["rb"]
    assert {r["run_id"] for r in call(socket_path, "runs")} == {"ra", "rb"}  # root sees all


def test_another_users_run_is_invisible_and_cannot_be_cancelled(
    socket_path: Path, database: Database
) -> None:
    for op in ("status", "events", "cancel"):
        reply = _call_as(BOB, socket_path, op, run_id="ra")
        assert reply == {"error": "no run ra visible to you (see `slurmft runs`)"}
    assert _call_as(BOB, socket_path, "status", run_id="nope")["error"].startswith("no run nope")
    with database.session() as s:
        run = s.get(Run, "ra")
        assert run is not None and run.cancel_requested_at is None


def test_the_owner_sees_status_and_events_and_can_cancel(
    socket_path: Path, database: Database
) -> None:
    status = _call_as(ALICE, socket_path, "status", run_id="ra")["result"]
    assert (status["name"], status["attempts"], status["excluded_nodes"]) == ("alice-run", 1, [])
    events = _call_as(ALICE, socket_path, "events", run_id="ra")["result"]
    assert [(e["source"], e["kind"]) for e in events["entries"]] == [("event", "node_lost")]
    assert _call_as(ALICE, socket_path, "cancel", run_id="ra")["result"]["cancel_requested"]
    with database.session() as s:
        run = s.get(Run, "ra")
        assert run is not None and run.cancel_requested_at is not None


def test_a_submission_that_failed_ends_its_pending_run_with_its_end_time(
    socket_path: Path, database: Database, seed_run: Callable[..., None]
) -> None:
    """`submit` reports an sbatch that failed: the run ends FAILED, its wall time with it."""
    seed_run(database, "rp", owner_uid=ALICE, owner_name="alice", running=False)
    reply = _call_as(ALICE, socket_path, "fail_run", run_id="rp", reason="sbatch: bad partition")
    assert reply == {"result": {"run_id": "rp", "state": "failed"}}
    with database.session() as s:
        run = s.get(Run, "rp")
        assert run is not None and run.end_reason == "sbatch: bad partition"
        assert run.ended_at is not None and run.ended_at >= run.created_at


def _attempts(database: Database, run_id: str) -> list[str | None]:
    with database.session() as s:
        return [
            a.slurm_job_id
            for a in s.query(Attempt).filter_by(run_id=run_id).order_by(Attempt.number)
        ]


def test_a_job_is_attached_only_to_its_owners_run_that_it_names(
    socket_path: Path, database: Database, seed_run: Callable[..., None]
) -> None:
    """Naming someone else's job would make the daemon cancel or requeue it with its own rights
    (`slurmft cancel`, a crash-loop stop, a batch-host requeue): Slurm's record decides."""
    # The recording's running job: UserId=root(0), Comment=slurmft-run:run-0001.
    job = recorded_jobs()[0]
    earlier = f"{job}0"  # the run's first attempt's job, another one
    seed_run(database, "run-0001", job_id=earlier, owner_uid=0, owner_name="root")
    refused = _call_as(ALICE, socket_path, "attach_job", run_id="ra", job_id=job)
    assert refused == {
        "error": f"job {job} is not run ra's: job {job} belongs to uid 0, the run to uid 15001"
    }
    wrong_run = call_error(socket_path, "attach_job", run_id="rb", job_id=job)
    assert "belongs to uid 0, the run to uid 15002" in wrong_run
    unknown = call_error(socket_path, "attach_job", run_id="rb", job_id="999999")
    assert unknown == "Slurm has no job 999999"
    assert _attempts(database, "ra") == [str(ALICE)] and _attempts(database, "rb") == [str(BOB)]
    attached = call(socket_path, "attach_job", run_id="run-0001", job_id=job)
    assert attached == {"run_id": "run-0001", "attempt": 2, "job_id": job}
    assert _attempts(database, "run-0001") == [earlier, job]


def call_error(path: Path, op: str, **args: Any) -> str:
    with pytest.raises(RpcError) as refused:
        call(path, op, **args)
    return str(refused.value)


def test_bad_requests_get_clear_errors(socket_path: Path) -> None:
    with pytest.raises(RpcError, match="unknown operation"):
        call(socket_path, "format_disk")
    with pytest.raises(RpcError, match="positive whole number"):
        call(socket_path, "events", run_id="ra", limit=-3)


def test_no_daemon_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnreachable, match="slurmft daemon is not running"):
        call(tmp_path / "absent.sock", "runs")


def test_cli_commands_go_through_the_socket(
    socket_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from slurmft.cli import main

    monkeypatch.setenv("SLURMFT_PATHS_RUNTIME_DIR", str(socket_path.parent))

    def run(*argv: str) -> str:
        with pytest.raises(SystemExit) as info:
            main(list(argv))
        out, err = capsys.readouterr()
        assert info.value.code == 0, err
        return out

    assert {r["run_id"] for r in json.loads(run("runs", "--json"))} == {"ra", "rb"}
    assert "alice-run" in run("status", "ra")
    assert "event  node_lost n2: lost n2" in run("events", "ra")
    assert "cancel requested for rb" in run("cancel", "rb")
    monkeypatch.setenv("SLURMFT_PATHS_RUNTIME_DIR", "/nonexistent")
    with pytest.raises(SystemExit) as info:
        main(["runs"])
    assert info.value.code == 1
    assert "daemon is not running" in capsys.readouterr().err


@pytest.mark.users
def test_members_of_the_admin_group_see_and_cancel_every_run_and_no_one_else_does(
    database: Database, seed_run: Callable[..., None]
) -> None:
    alice, bob = pwd.getpwnam("slurmft-alice"), pwd.getpwnam("slurmft-bob")
    for run_id, user in (("alices", alice), ("bobs", bob)):
        seed_run(database, run_id, job_id="7", owner_uid=user.pw_uid, owner_name=user.pw_name)
    slurm = CliSlurmClient(RecordedCluster(["show_job_running"]))
    # Each test user has a group of their own: alice's makes her, and only her, an admin.
    ops = operations(database, slurm=slurm, admins=Admins("slurmft-alice"))
    assert {r["run_id"] for r in ops["runs"](alice.pw_uid, {})} == {"alices", "bobs"}
    assert ops["status"](alice.pw_uid, {"run_id": "bobs"})["owner"] == "slurmft-bob"
    assert ops["cancel"](alice.pw_uid, {"run_id": "bobs"})["cancel_requested"]
    assert [r["run_id"] for r in ops["runs"](bob.pw_uid, {})] == ["bobs"]
    with pytest.raises(RpcError, match="no run alices visible to you"):
        ops["cancel"](bob.pw_uid, {"run_id": "alices"})
    # A group that does not exist makes no one an admin but root.
    typo = operations(database, slurm=slurm, admins=Admins("slurmft-alcie"))
    assert [r["run_id"] for r in typo["runs"](alice.pw_uid, {})] == ["alices"]
    assert {r["run_id"] for r in typo["runs"](0, {})} == {"alices", "bobs"}
    with database.session() as s:
        cancelled = s.get(Run, "bobs")
        kept = s.get(Run, "alices")
        assert cancelled is not None and cancelled.cancel_requested_at is not None
        assert kept is not None and kept.cancel_requested_at is None


def _run_ids(database: Database) -> set[str]:
    with database.session() as s:
        return {run.id for run in s.query(Run)}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"script": ["tr\udcffain.py"]}, "bad script"),  # a non-UTF-8 byte, as Python reads it
        ({"name": "x\n"}, "bad name"),
        ({"time_limit": "60\n"}, "bad time_limit"),
        ({"nodes": 10**30}, "bad nodes"),
        ({"env": {"A": "\x00"}}, "bad env"),
    ],
)
def test_the_daemon_refuses_a_hostile_spec_and_creates_no_run(
    socket_path: Path, database: Database, change: dict[str, Any], needle: str
) -> None:
    """Issue 14 item 15, the daemon's side: a client that skips the CLI's checks gets the
    spec error (not "internal error"), and no run is left pending."""
    before = _run_ids(database)
    spec = {"name": "x", "nodes": 1, "script": ["train.py"], "ckpt_dir": "/shared/x", **change}
    error = call_error(socket_path, "create_run", spec=spec)
    assert needle in error and "internal error" not in error
    assert _run_ids(database) == before


@pytest.mark.parametrize("named", [["--name", "llama"], []])
def test_submit_with_a_non_utf8_argument_is_one_clear_line_and_no_run(  # noqa: PLR0917 (fixtures)
    named: list[str],
    socket_path: Path,
    database: Database,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 14 item 15: `slurmft submit -- $'tr\\xffain.py'` printed a traceback and left the
    run pending for ever; it is refused before any run is created."""
    from slurmft.api import submission
    from slurmft.cli import main

    def never(*_: object) -> None:
        raise AssertionError("nothing may reach Slurm")

    monkeypatch.setattr(submission, "_submit_job", never)
    monkeypatch.setenv("SLURMFT_PATHS_RUNTIME_DIR", str(socket_path.parent))
    before = _run_ids(database)
    argv = ["submit", "--nodes", "1", "--ckpt-dir", str(tmp_path), *named, "--", "tr\udcffain.py"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("slurmft: error: bad script: 'tr\\udcffain.py' is not valid UTF-8")
    assert "Traceback" not in err and err.count("\n") == 1
    assert _run_ids(database) == before


def test_a_submission_that_fails_unexpectedly_leaves_no_pending_run(
    socket_path: Path, database: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails between create_run and attach_job, the run is marked failed, with why."""
    from slurmft.api import submission
    from slurmft.cli import main
    from slurmft.db.states import RunState

    def broken(*_: object) -> None:
        raise UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(submission, "_submit_job", broken)
    monkeypatch.setenv("SLURMFT_PATHS_RUNTIME_DIR", str(socket_path.parent))
    before = _run_ids(database)
    with pytest.raises(UnicodeEncodeError):
        main(["submit", "--nodes", "1", "--ckpt-dir", str(tmp_path), "--", "train.py"])
    (new,) = _run_ids(database) - before
    with database.session() as s:
        run = s.get(Run, new)
        assert run is not None and run.state is RunState.FAILED
        assert run.end_reason is not None and "UnicodeEncodeError" in run.end_reason


def test_submit_into_a_linked_state_dir_is_refused_before_any_run(
    socket_path: Path,
    database: Database,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 14 item 11: a `.slurmft` someone planted as a link is refused with what to do,
    before the daemon creates the run and before the token is written anywhere."""
    from slurmft.api import submission
    from slurmft.cli import main

    def never(*_: object) -> None:
        raise AssertionError("nothing may reach Slurm")

    monkeypatch.setattr(submission, "_submit_job", never)
    monkeypatch.setenv("SLURMFT_PATHS_RUNTIME_DIR", str(socket_path.parent))
    (tmp_path / "theirs").mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".slurmft").symlink_to(tmp_path / "theirs")
    before = _run_ids(database)
    with pytest.raises(SystemExit) as info:
        main(["submit", "--nodes", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--", "train.py"])
    assert info.value.code == 2
    assert "is not a directory" in capsys.readouterr().err
    assert _run_ids(database) == before
    assert list((tmp_path / "theirs").iterdir()) == []


def test_history_shows_each_user_their_own_runs_and_everyone_the_nodes(socket_path: Path) -> None:
    def run_rows(uid: int | None) -> set[str]:
        ask = (
            (lambda **a: call(socket_path, "history", **a))
            if uid is None
            else (lambda **a: _call_as(uid, socket_path, "history", **a)["result"])
        )
        return {r["run_id"] for r in ask(view="run_failures")["rows"]}

    assert run_rows(ALICE) == {"ra"} and run_rows(BOB) == {"rb"}
    assert run_rows(None) == {"ra", "rb"}  # root: every run
    nodes = _call_as(ALICE, socket_path, "history", view="failures_by_node")["result"]["rows"]
    assert [(r["node"], r["failures"], r["runs"]) for r in nodes] == [("n2", 2, 2)]
    hidden = _call_as(ALICE, socket_path, "history", view="run_failures", run_id="rb")
    assert hidden == {"error": "no run rb visible to you (see `slurmft runs`)"}
    assert "unknown view" in _call_as(ALICE, socket_path, "history", view="runs")["error"]


def test_a_report_is_of_a_run_the_caller_may_see(socket_path: Path) -> None:
    other = _call_as(ALICE, socket_path, "report", run_id="rb")
    assert other == {"error": "no run rb visible to you (see `slurmft runs`)"}
    own = _call_as(ALICE, socket_path, "report", run_id="ra")
    assert "has no step times" in own["error"]  # hers: past the visibility check
    bad = _call_as(ALICE, socket_path, "report", run_id="ra", max_columns=10**9)
    assert "max_columns" in bad["error"]


def test_only_an_admin_releases_a_held_run_over_the_socket(
    socket_path: Path, database: Database
) -> None:
    with database.session() as s:
        run = s.get(Run, "ra")
        assert run is not None
        run.control_failures, run.control_error = 3, "deciding: KeyError: 'x'"
    assert _call_as(ALICE, socket_path, "status", run_id="ra")["result"]["held"] is True
    refused = _call_as(ALICE, socket_path, "release_run", run_id="ra")
    assert refused["error"] == "only an admin (root, or daemon.admin_group) may release a held run"
    released = _call_as(0, socket_path, "release_run", run_id="ra")["result"]
    assert released == {
        "run_id": "ra", "released": True, "failures": 3, "error": "deciding: KeyError: 'x'"
    }  # fmt: skip
    status = _call_as(ALICE, socket_path, "status", run_id="ra")["result"]
    assert (status["held"], status["control_failures"], status["control_error"]) == (False, 0, None)
    assert _call_as(0, socket_path, "release_run", run_id="ra")["result"]["released"] is False
