"""Running the example training script under torchrun (gloo, CPU) and reading what it wrote."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.processes import run_dumping_stacks_on_overrun
from support.waiting import wait_for

from slurmft.train.report import decode

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
RUN_TIMEOUT_S = 240


@dataclass
class TinyRun:
    workdir: Path
    returncode: int
    output: str

    @property
    def ckpt_dir(self) -> Path:
        return self.workdir / "ckpt"

    @property
    def out_dir(self) -> Path:
        return self.workdir / "out"

    def records(self) -> list[dict[str, Any]]:
        path = self.out_dir / "losses.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def steps(self) -> dict[int, dict[str, Any]]:
        """The last record of every step (a resumed run repeats the steps after its checkpoint)."""
        return {record["step"]: record for record in self.records()}

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        path = self.out_dir / "events.jsonl"
        if not path.exists():
            return []
        found = [json.loads(line) for line in path.read_text().splitlines()]
        return [e for e in found if name is None or e["event"] == name]

    def final_weights(self) -> dict[str, Any]:
        import torch

        return torch.load(self.out_dir / "final_weights.pt")


TINY = "slurmft.train.examples.tiny"


def torchrun_command(
    nproc: int, max_restarts: int, args: list[str], module: str = TINY
) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        "-m",
        module,
        *args,
    ]


def torchrun_env(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            # torch 2.13 workers reusing the agent's store fail to re-form the process group
            # after a restart (notes/torchrun.md); the agent sets this too.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",  # the Hugging Face runs never reach a hub
            "SLURMFT_STACKS_DIR": str(workdir / "stacks"),
        }
    )
    env.pop("SLURMFT_AGENT_SOCKET", None)
    env.update(extra or {})
    return env


def run_tiny(
    workdir: Path,
    *args: str,
    nproc: int = 3,
    max_restarts: int = 0,
    ckpt_dir: str | None = None,
    env: dict[str, str] | None = None,
) -> TinyRun:
    """The hand-written example (slurmft.train.examples.tiny) under torchrun."""
    return run_module(TINY, workdir, *args, nproc=nproc, max_restarts=max_restarts,
                      ckpt_dir=ckpt_dir, env=env)  # fmt: skip


def run_module(
    module: str,
    workdir: Path,
    *args: str,
    nproc: int = 2,
    max_restarts: int = 0,
    agent: AgentSocket | None = None,
    ckpt_dir: str | None = None,
    env: dict[str, str] | None = None,
) -> TinyRun:
    """An example training module (its --ckpt-dir and --out-dir under ``workdir`` unless
    given) under torchrun, its ranks reporting to ``agent`` when given."""
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir or str(workdir / "ckpt")
    argv = ["--ckpt-dir", ckpt, "--out-dir", str(workdir / "out"), *args]
    extra = {"SLURMFT_AGENT_SOCKET": str(agent.path)} if agent is not None else {}
    done = run_dumping_stacks_on_overrun(
        torchrun_command(nproc, max_restarts, argv, module=module),
        timeout_s=RUN_TIMEOUT_S,
        stacks_dir=workdir / "stacks",
        env=torchrun_env(workdir, {**extra, **(env or {})}),
        cwd=workdir,
    )
    return TinyRun(workdir, done.returncode, done.stdout)


def copy_run(run: TinyRun, workdir: Path, keep_steps: set[int] | None = None) -> Path:
    """A copy of a run's checkpoint directory (optionally only some steps) for a new run."""
    target = workdir / "ckpt"
    shutil.copytree(run.ckpt_dir, target)
    if keep_steps is not None:
        for entry in target.iterdir():
            if int(entry.name.removeprefix("step-")) not in keep_steps:
                shutil.rmtree(entry)
    return target


class AgentSocket:
    """What the node agent will do: receive the ranks' datagrams (here: keep them all)."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                payload = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), decode(payload)))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [m for _, m in self.messages if m["kind"] == kind]

    def close(self) -> None:
        """Stop receiving, and keep what the kernel still holds: a rank's last datagrams (an
        exit's report) can arrive just before its run ends, after the thread's last read."""
        self._stop.set()
        self._thread.join()
        self.sock.setblocking(False)
        while True:
            try:
                payload = self.sock.recv(65536)
            except BlockingIOError:
                break
            self.messages.append((time.monotonic(), decode(payload)))
        self.sock.close()


def run_with_save_request(module: str, workdir: Path, *args: str) -> tuple[TinyRun, int]:
    """A run at world size 2 whose save-request file is touched (what the agent does on Slurm's
    time-limit signal) once it has written step 10; the run and the last step written before."""
    request_file = workdir / "save-request"
    argv = ["--ckpt-dir", str(workdir / "ckpt"), "--out-dir", str(workdir / "out"), *args]
    env = torchrun_env(workdir, {"SLURMFT_SAVE_REQUEST_FILE": str(request_file)})
    process = subprocess.Popen(
        torchrun_command(2, 0, argv, module=module), cwd=workdir, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        losses = workdir / "out" / "losses.jsonl"
        wait_for_step(losses, 10, process)
        requested_after = max(json.loads(x)["step"] for x in losses.read_text().splitlines())
        request_file.touch()
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    return TinyRun(workdir, process.returncode, output), requested_after


def wait_for_step(losses: Path, step: int, process: subprocess.Popen[str]) -> None:
    def reached() -> bool:
        if losses.exists() and any(
            json.loads(line)["step"] >= step for line in losses.read_text().splitlines()
        ):
            return True
        # An ended run will never get there: fail now, not at the timeout.
        assert process.poll() is None, f"the run ended before step {step}"
        return False

    wait_for(reached, RUN_TIMEOUT_S, f"the run to reach step {step}", interval_s=0.05)


def assert_phases_and_step_timings(messages: list[dict[str, Any]], steps: int) -> None:
    """Both ranks' heartbeats went through init, step and done; each sent every step's timing,
    compute and wait within the step's total."""
    beats = [m for m in messages if m["kind"] == "heartbeat"]
    assert {m["rank"] for m in beats} == {0, 1}
    assert {"init", "step", "done"} <= {m["phase"] for m in beats}
    timings = [m for m in messages if m["kind"] == "step"]
    for rank in (0, 1):
        mine = [m for m in timings if m["rank"] == rank]
        seen = [m["step"] for m in mine]
        assert seen == list(range(1, steps + 1)), f"rank {rank} sent step timings for {seen}"
        for m in mine:
            assert m["compute_s"] > 0 and m["wait_s"] >= 0
            assert m["total_s"] >= m["compute_s"] + m["wait_s"]
