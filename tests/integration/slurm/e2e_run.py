"""Shared pieces of the end-to-end tests: a run submitted with `slurmft submit` under a daemon
process, and what the store and the run's files say about it."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon_process import DaemonProcess, slurmft
from local_cluster import Cluster
from sqlalchemy import func, select
from support.processes import workers
from support.waiting import wait_for_value

from slurmft.db import Database
from slurmft.db.models import Action, Attempt, Event, RankHeartbeat, Run
from slurmft.db.states import RunState

if TYPE_CHECKING:
    from unix_users import UnixUser

# The example at a pace two cores keep up with: 3 ranks, a checkpoint every 5 steps.
TINY = [
    "--steps",
    "60",
    "--ckpt-every",
    "5",
    "--work-ms",
    "150",
    "--heartbeat-interval-s",
    "1",
    "--pg-timeout-s",
    "30",
]
# The example under a worker that first records what it runs in (identity.jsonl).
IDENTITY_TRAIN = str(Path(__file__).with_name("identity_train.py"))
# The example's own script arguments; `submit` fills in the directories.
EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", *TINY]


@dataclass
class SubmittedRun:
    run_id: str
    job_id: str
    shared: Path  # every node's shared directory: checkpoints, job log, outputs
    database: Database

    @property
    def ckpt_dir(self) -> Path:
        return self.shared / "ckpt"

    @property
    def out(self) -> Path:
        return self.shared / "out"

    def job_log(self) -> str:
        logs = sorted((self.ckpt_dir / ".slurmft").glob("slurm-*.out"))
        return "\n".join(p.read_text(errors="replace") for p in logs)

    def jsonl(self, name: str) -> list[dict[str, Any]]:
        path = self.out / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def beating_nodes(self) -> dict[int, str]:
        with self.database.session() as s:
            rows = s.scalars(select(RankHeartbeat).where(RankHeartbeat.run_id == self.run_id)).all()
            return {hb.rank: hb.node for hb in rows}

    def run(self) -> Run:
        with self.database.session() as s:
            run = s.get(Run, self.run_id)
            assert run is not None
            s.expunge(run)
            return run

    def attempts(self) -> list[Attempt]:
        with self.database.session() as s:
            rows = s.scalars(
                select(Attempt).where(Attempt.run_id == self.run_id).order_by(Attempt.number)
            ).all()
            for row in rows:
                s.expunge(row)
            return list(rows)

    def events(self, *where: object) -> list[Event]:
        with self.database.session() as s:
            rows = s.scalars(
                select(Event).where(Event.run_id == self.run_id, *where).order_by(Event.id)
            ).all()
            for row in rows:
                s.expunge(row)
            return list(rows)

    def actions(self, *where: object) -> list[Action]:
        with self.database.session() as s:
            rows = s.scalars(
                select(Action).where(Action.run_id == self.run_id, *where).order_by(Action.id)
            ).all()
            for row in rows:
                s.expunge(row)
            return list(rows)

    def wait_training(self, past_step: int = 10) -> None:
        """Until three ranks report heartbeats and training reached ``past_step`` (a
        checkpoint lies behind it)."""
        wait_for_value(
            f"training at step {past_step}, reported by three ranks",
            self.beating_nodes,
            lambda ranks: (
                len(ranks) == 3 and any(r["step"] >= past_step for r in self.jsonl("losses.jsonl"))
            ),
            timeout_s=180,
        )

    def wait_replaced(self, victim: str, timeout_s: float = 120) -> float:
        """Until three ranks report again and none from `victim` (a spare trains in its place);
        returns the seconds it took."""
        _, seconds = wait_for_value(
            f"a spare to train in {victim}'s place",
            self.beating_nodes,
            lambda ranks: victim not in ranks.values() and len(ranks) == 3,
            timeout_s=timeout_s,
        )
        return seconds

    def latest_step(self) -> int:
        return max((r["step"] for r in self.jsonl("losses.jsonl")), default=0)

    def wait_completed(self, steps: int, timeout_s: float = 240) -> None:
        """Until training wrote its last step and the run ended COMPLETED (a run that lost a
        node to a cordon must complete too, not be relaunched until its budget stops it)."""
        wait_for_value(
            f"step {steps}",
            self.latest_step,
            lambda step: step == steps,
            timeout_s=timeout_s,
        )
        final, _ = wait_for_value("the run to end", self.run, lambda r: r.state.is_terminal, 120)
        assert (final.state, final.end_reason) == (
            RunState.COMPLETED,
            "the training script finished",
        ), self.job_log()[-3000:]

    def count_events(self, *where: object) -> int:
        with self.database.session() as s:
            return s.scalar(select(func.count()).select_from(Event).where(*where)) or 0


def submit(
    cluster: Cluster,
    daemon: DaemonProcess,
    tmp_path: Path,
    script: list[str],
    *,
    name: str,
    nodes: int = 3,
    spares: int = 1,
    env: dict[str, str] | None = None,
    as_user: UnixUser | None = None,
    fields: dict[str, object] | None = None,
) -> SubmittedRun:
    """`slurmft submit` a run of `nodes` + `spares` (with `env` in the job's environment, through
    a spec file); `{ckpt}` and `{out}` in the script's arguments become its checkpoint and output
    directories. The fixture cancels the job. ``as_user`` submits as that test user: the job
    runs as them, so ``tmp_path`` must be reachable by them (not pytest's own tmp_path).
    ``fields``: more run-spec fields (strings or lists of strings)."""
    shared = tmp_path / "shared"
    if as_user is not None:
        as_user.own(shared)
    else:
        shared.mkdir(mode=0o777)
    ckpt, out = shared / "ckpt", shared / "out"
    argv = [a.replace("{ckpt}", str(ckpt)).replace("{out}", str(out)) for a in script]
    spec = tmp_path / "run.toml"
    spec.write_text(
        f"name = {json.dumps(name)}\nnodes = {nodes}\nspares = {spares}\n"
        f"ckpt_dir = {json.dumps(str(ckpt))}\nscript = {json.dumps(argv)}\n"
        + "".join(f"{key} = {json.dumps(value)}\n" for key, value in (fields or {}).items())
        + "[env]\n"
        + "".join(f"{key} = {json.dumps(value)}\n" for key, value in (env or {}).items())
    )
    cli = daemon.env if as_user is None else daemon.client_env()
    submitted = json.loads(slurmft(cli, "submit", "--spec", str(spec), "--json", as_user=as_user))
    cluster._jobs.append(submitted["job_id"])  # cancelled by the fixture whatever happens
    database = Database(f"sqlite:///{daemon.env['SLURMFT_PATHS_STATE_DIR']}/slurmft.db")
    return SubmittedRun(submitted["run_id"], submitted["job_id"], shared, database)


def run_processes_on(run: SubmittedRun, node: str) -> set[int]:
    """The run's processes on one emulated node (all nodes share this host): those whose
    environment names the node and whose command line names the run's checkpoint directory."""
    wanted = b"SLURMD_NODENAME=" + node.encode()
    ckpt = str(run.ckpt_dir).encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked
        if ckpt in cmdline and wanted in environ:
            found.add(int(entry.name))
    return found


def second_venv(where: Path) -> Path:
    """A venv of its own whose packages are the first one's (a `.pth` that adds its
    site-packages, editable installs included), so the job's interpreter is not this one."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=120)  # fmt: skip
    site = where / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    pth = site / "site-packages" / "first_venv.pth"
    pth.write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return where / "bin" / "python"


def worker_pid(run: SubmittedRun, rank: int) -> int:
    """The training process of `rank` in the run (all nodes run on this host; job ids repeat
    across clusters, checkpoint directories do not)."""
    wanted = b"RANK=" + str(rank).encode()
    ranks = workers("slurmft.train.examples.tiny", str(run.ckpt_dir).encode())
    found = [pid for pid, _argv, environ in ranks if wanted in environ]
    assert len(found) == 1, f"rank {rank} of run {run.run_id}: processes {found}"
    return found[0]
