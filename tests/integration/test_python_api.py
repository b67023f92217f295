"""The Python API against the daemon's real socket server and store: typed answers that carry
every field the daemon sends, the timeline's cursor, wait, cancel, and a spec refused the way
the CLI refuses it, before any run exists."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from support.slurm_recordings import RecordedCluster

import slurmft
from slurmft.api import (
    ActionRecord,
    Checkpoint,
    EffectiveTime,
    EventPage,
    Run,
    RunState,
    RunStatus,
    RunSummary,
    SpecError,
    SubmitNote,
    TimelineEntry,
    WaitTimeout,
    plan_submission,
    runs,
)
from slurmft.api import runs as api_runs
from slurmft.config import Config, load_config
from slurmft.controller.rpc import DaemonUnreachable, RpcError, RpcServer, call
from slurmft.controller.user_ops import operations
from slurmft.db import Database
from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind
from slurmft.db.models import Run as StoredRun
from slurmft.slurm.cli_backend import CliSlurmClient


@dataclass
class Daemon:
    """The daemon's user operations on its socket, over a SQLite store."""

    database: Database
    config: Config

    @property
    def socket_path(self) -> Path:
        return self.config.runtime_dir / "slurmft.sock"

    def set_state(self, run_id: str, state: RunState) -> None:
        with self.database.session() as session:
            run = session.get(StoredRun, run_id)
            assert run is not None
            run.state = state
            if state.is_terminal:
                run.ended_at = datetime.now(UTC)


def _config(runtime: Path) -> Config:
    return load_config(
        environ={}, system_file=Path("/nonexistent"), overrides=[f"paths.runtime_dir={runtime}"]
    )


@pytest.fixture
def daemon(tmp_path: Path, seed_run: Callable[..., None]) -> Iterator[Daemon]:
    database = Database(f"sqlite:///{tmp_path / 'slurmft.db'}")
    database.upgrade()
    seed = seed_run
    started = datetime.now(UTC) - timedelta(minutes=10)
    seed(database, "r1", job_id="101", name="first", started_at=started, first_step_at=started)
    seed(database, "r2", job_id="102", name="second")
    with database.session() as s:
        s.add(Event(run_id="r1", kind=EventKind.NODE_LOST, node="n2", message="lost n2"))
        s.add(
            Event(
                run_id="r1",
                kind=EventKind.CHECKPOINT,
                source="agent",
                node="n1",
                message="checkpoint step 40",
                details={"step": 40},
            )
        )
        s.add(
            Action(
                run_id="r1",
                kind=ActionKind.DRAIN_NODE,
                node="n2",
                status=ActionStatus.DONE,
                reason="node n2 lost: no heartbeat for 60 s",
            )
        )
        s.add(
            Action(
                run_id="r1",
                kind=ActionKind.NOTIFY,
                status=ActionStatus.DONE,
                reason="crash loop: a person should look at the script",
            )
        )
    runtime = Path(tempfile.mkdtemp(prefix="slurmft-api-"))
    slurm = CliSlurmClient(RecordedCluster(["show_job_running", "show_job_unknown"]))
    server = RpcServer(runtime / "slurmft.sock", operations(database, slurm=slurm)).start()
    try:
        yield Daemon(database, _config(runtime))
    finally:
        server.stop()
        shutil.rmtree(runtime, ignore_errors=True)
        database.dispose()


def _typed(record: type) -> set[str]:
    return {f.name for f in fields(record)} - {"raw"}


def test_status_is_typed_and_types_every_field_the_daemon_sends(daemon: Daemon) -> None:
    answer = call(daemon.socket_path, "status", run_id="r1")
    status = Run("r1", config=daemon.config).status()
    # A field the daemon adds must be typed here too (or this fails): the API is the
    # structure of `slurmft status --json`, and the CLI prints its to_dict().
    assert set(answer) == _typed(RunStatus)
    assert set(answer["checkpoint"]) == _typed(Checkpoint)
    assert set(answer["recent_actions"][0]) == _typed(ActionRecord)
    assert set(status.to_dict()) == set(answer)
    assert status.state is RunState.RUNNING and not status.ended
    assert (status.run_id, status.name, status.job_id, status.attempts) == ("r1", "first", "101", 1)
    assert isinstance(status.created_at, datetime) and status.created_at.tzinfo is not None
    assert status.checkpoint is not None
    assert (status.checkpoint.step, status.checkpoint.verified) == (40, True)
    assert [(a.kind, a.node, a.status) for a in status.recent_actions] == [
        ("drain_node", "n2", "done"),
        ("notify", None, "done"),
    ]
    assert [a.reason for a in status.human_needed] == [
        "crash loop: a person should look at the script"
    ]


def test_a_runs_effective_time_is_typed(daemon: Daemon) -> None:
    answer = call(daemon.socket_path, "status", run_id="r1")
    assert set(answer["effective"]) == _typed(EffectiveTime)
    effective = Run("r1", config=daemon.config).status().effective
    assert isinstance(effective, EffectiveTime)
    assert effective.wall_s == pytest.approx(600, abs=30) and effective.ratio == 1.0


def test_runs_lists_summaries_newest_first_and_filters_by_state(daemon: Daemon) -> None:
    listed = runs(config=daemon.config)
    assert [r.run_id for r in listed] == ["r2", "r1"]
    assert set(call(daemon.socket_path, "runs")[0]) == _typed(RunSummary)
    assert all(isinstance(r, RunSummary) and r.state is RunState.RUNNING for r in listed)
    daemon.set_state("r2", RunState.COMPLETED)
    assert [r.run_id for r in api_runs(states=["completed"], config=daemon.config)] == ["r2"]
    assert api_runs(since=datetime(2999, 1, 1).astimezone(), config=daemon.config) == []


def test_events_are_typed_and_the_cursor_gives_only_what_came_after(daemon: Daemon) -> None:
    run = Run("r1", config=daemon.config)
    page = run.events()
    assert isinstance(page, EventPage) and set(page.to_dict()) == _typed(EventPage)
    assert set(page.to_dict()["entries"][0]) == _typed(TimelineEntry)
    kinds = [(e.source, e.kind) for e in page.entries]
    assert ("event", "node_lost") in kinds and ("action", "drain_node") in kinds
    lost = next(e for e in page.entries if e.kind == "node_lost")
    assert lost.nodes == ("n2",) and lost.text == "lost n2"
    assert run.events(after=page.cursor).entries == ()
    with daemon.database.session() as s:
        s.add(Event(run_id="r1", kind=EventKind.NODE_LOST, node="n3", message="lost n3"))
    newer = run.events(after=page.cursor)
    assert [(e.kind, e.nodes) for e in newer.entries] == [("node_lost", ("n3",))]


def test_follow_yields_the_timeline_and_returns_once_the_run_has_ended(daemon: Daemon) -> None:
    daemon.set_state("r1", RunState.COMPLETED)
    followed = list(Run("r1", config=daemon.config).follow(interval_s=0.05))
    assert [e.kind for e in followed] == [e.kind for e in Run("r1", config=daemon.config)
                                          .events().entries]  # fmt: skip


def test_wait_returns_the_final_status_when_the_run_ends(daemon: Daemon) -> None:
    ender = threading.Timer(0.5, daemon.set_state, ("r1", RunState.COMPLETED))
    ender.start()
    started = time.monotonic()
    final = Run("r1", config=daemon.config).wait(timeout_s=30, poll_s=0.1)
    ender.join()
    assert final.state is RunState.COMPLETED and final.ended
    assert 0.4 <= time.monotonic() - started < 10


def test_wait_gives_up_at_its_timeout_and_the_run_goes_on(daemon: Daemon) -> None:
    with pytest.raises(WaitTimeout, match="r1 had not ended after"):
        Run("r1", config=daemon.config).wait(timeout_s=0.3, poll_s=0.1)
    assert Run("r1", config=daemon.config).status().state is RunState.RUNNING


def test_wait_asks_again_while_the_daemon_is_away_then_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slurmft.api.run as api_run_module

    monkeypatch.setattr(api_run_module, "DAEMON_AWAY_S", 0.3)
    asked = 0
    real_status = Run.status

    def counted(self: Run) -> RunStatus:
        nonlocal asked
        asked += 1
        return real_status(self)

    monkeypatch.setattr(Run, "status", counted)
    with pytest.raises(DaemonUnreachable, match="not running"):
        Run("r1", config=_config(tmp_path)).wait(poll_s=0.05)
    assert asked >= 3  # asked again, not given up at the first refusal


def test_cancel_asks_the_daemon_and_a_run_that_ended_is_refused(daemon: Daemon) -> None:
    Run("r1", config=daemon.config).cancel()
    assert Run("r1", config=daemon.config).status().cancel_requested
    daemon.set_state("r2", RunState.FAILED)
    with pytest.raises(RpcError, match=r"already ended \(failed\)"):
        Run("r2", config=daemon.config).cancel()
    with pytest.raises(RpcError, match="no run"):
        Run("nope", config=daemon.config).status()


def test_a_bad_spec_is_refused_before_any_run_exists(daemon: Daemon) -> None:
    before = [r.run_id for r in runs(config=daemon.config)]
    with pytest.raises(SpecError, match="nodes"):
        slurmft.submit({"nodes": 0, "ckpt_dir": "/shared/ck", "script": ["train.py"]},
                       config=daemon.config)  # fmt: skip
    with pytest.raises(SpecError, match="unknown field 'node'"):
        slurmft.submit({"node": 2, "ckpt_dir": "/shared/ck", "script": ["train.py"]},
                       config=daemon.config)  # fmt: skip
    with pytest.raises(SpecError, match="not int"):
        slurmft.submit(3, config=daemon.config)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="does not exist"):
        slurmft.submit("/nonexistent/run.toml", config=daemon.config)
    assert [r.run_id for r in runs(config=daemon.config)] == before


def test_a_plan_from_a_mapping_names_the_run_after_its_script_and_warns_its_notes(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SBATCH_PARTITION", "gpu")  # not passed on: the note says so
    spec = {
        "nodes": 2,
        "spares": 0,
        "ckpt_dir": str(tmp_path / "ck"),
        "script": ["-m", "pkg.pretrain", "--lr", "0.1"],
        "sbatch_args": ["--mail-type=END"],
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_submission(spec, config=daemon.config)
    notes = [str(w.message) for w in caught if issubclass(w.category, SubmitNote)]
    assert any("SBATCH_PARTITION" in note for note in notes), notes
    assert all(w.filename == __file__ for w in caught if issubclass(w.category, SubmitNote))
    assert "--job-name=slurmft-pretrain" in plan.sbatch_argv
    assert "--mail-type=END" in plan.sbatch_argv
    assert "-m pkg.pretrain --lr 0.1" in plan.batch_script
    heard: list[str] = []
    plan_submission(spec, config=daemon.config, on_note=heard.append)
    assert notes == heard
