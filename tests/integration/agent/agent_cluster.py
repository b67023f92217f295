"""A "cluster" of node agents on localhost: one standalone store, N + S `slurmft agent run`.

A node is killed the way a node dies: SIGKILL of its agent, torchrun and workers together
(torchrun starts the workers in new sessions, so the tree is walked, not a process group).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.processes import argv_of, is_worker
from support.waiting import wait_for

from slurmft.agent.procs import descendants, kill_tree
from slurmft.agent.store import StoreSupervisor

SLURMFT = str(Path(sys.executable).parent / "slurmft")
TINY = "slurmft.train.examples.tiny"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # The config refuses unknown SLURMFT_* variables; the channel variables are the agent's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


@dataclass
class Agent:
    index: int
    process: subprocess.Popen[bytes]
    log_path: Path
    work_dir: Path

    def worker_pids(self) -> list[int]:
        found = []
        for pid in descendants(self.process.pid):
            try:
                argv = argv_of(pid)
                if is_worker(pid, argv, TINY):
                    found.append(pid)
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class AgentCluster:
    root: Path
    nodes: int
    script_args: list[str]
    settings: list[str] = field(default_factory=list)  # --set key=value for every agent
    nproc_per_node: int = 1
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every agent
    agents: list[Agent] = field(default_factory=list)
    store: StoreSupervisor | None = None
    run_id: str = "t"

    @property
    def out_dir(self) -> Path:
        return self.root / "out"

    def start_store(self) -> None:
        self.store = StoreSupervisor("127.0.0.1", free_port(), python=sys.executable).start()

    def start_agent(self, index: int) -> Agent:
        assert self.store is not None
        work_dir = Path(tempfile.mkdtemp(prefix=f"sft{index}-"))  # short: holds a unix socket
        log_path = self.root / f"agent{index}.log"
        argv = [SLURMFT]
        for setting in self.settings:
            argv += ["--set", setting]
        argv += [
            "agent",
            "run",
            f"--nodes={self.nodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--rdzv-endpoint={self.store.endpoint}",
            f"--run-id={self.run_id}",
            f"--node-index={index}",
            f"--node-name=n{index}",
            f"--work-dir={work_dir}",
            "--",
            "-m",
            TINY,
            "--ckpt-dir",
            str(self.root / "ckpt"),
            "--out-dir",
            str(self.out_dir),
            *self.script_args,
        ]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
                env=clean_env(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        agent = Agent(index, process, log_path, work_dir)
        self.agents.append(agent)
        return agent

    def start(self, count: int) -> None:
        self.start_store()
        for index in range(count):
            self.start_agent(index)

    def kill_node(self, agent: Agent) -> float:
        """SIGKILL the agent and everything below it; returns the kill time (time.time())."""
        kill_tree(agent.process.pid)
        killed_at = time.time()
        agent.process.wait(timeout=10)
        return killed_at

    def active_agents(self) -> list[Agent]:
        return [a for a in self.agents if a.process.poll() is None and a.worker_pids()]

    def records(self) -> list[dict[str, Any]]:
        return _jsonl(self.out_dir / "losses.jsonl")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        found = _jsonl(self.out_dir / "events.jsonl")
        return [e for e in found if name is None or e["event"] == name]

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        wait_for(
            lambda: any(r["step"] >= step for r in self.records()),
            timeout_s,
            lambda: f"step {step}\n{self.logs_tail()}",
        )

    def wait_done(self, timeout_s: float) -> None:
        wait_for(
            lambda: self.events("done"), timeout_s, lambda: f"the run to finish\n{self.logs_tail()}"
        )

    def highest_round(self) -> int:
        """The newest rendezvous round any agent's torchrun joined (each agent logs the rounds
        its launcher tells it): every restart is a new round, so a restart loop shows as round
        after round, however the workers were stopped."""
        rounds = [
            int(number)
            for agent in self.agents
            for match in _ROUND.finditer(agent.log())
            for number in match.groups()
            if number is not None
        ]
        return max(rounds, default=-1)

    def logs_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- agent {a.index}\n{a.log()[-chars:]}" for a in self.agents)

    def stop(self) -> None:
        for agent in self.agents:
            if agent.process.poll() is None:
                kill_tree(agent.process.pid)
                agent.process.wait(timeout=10)
        if self.store is not None:
            self.store.stop()
        for agent in self.agents:  # a killed agent leaves its tmpfs snapshot folder behind
            shutil.rmtree(f"/dev/shm/slurmft-{os.getuid()}-{agent.work_dir.name}", True)


_ROUND = re.compile(r"rendezvous round (\d+)(?: -> (\d+))?")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]
