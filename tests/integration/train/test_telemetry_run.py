"""One telemetry run under torchrun (gloo, world size 3) with an agent socket: a rank that turns
30 % slower is named from the timings, a save longer than the step deadline is reported as
checkpointing, a save request makes every rank save at the same step, and SIGUSR2 dumps stacks."""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
from collections import defaultdict
from typing import Any

import pytest
from tiny_runs import (
    RUN_TIMEOUT_S,
    AgentSocket,
    TinyRun,
    torchrun_command,
    torchrun_env,
    wait_for_step,
)

# serial: a rank 30% slower than its peers, a save longer than the step deadline.
pytestmark = [pytest.mark.torch, pytest.mark.serial]

STEPS = 45
SLOW_FROM_STEP = 20
WINDOW = 10
STEP_DEADLINE_S = 1.0
SLOW_SAVE_S = 2.5
HEARTBEAT_INTERVAL_S = 0.25


@pytest.fixture(scope="module")
def telemetry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyRun, AgentSocket, dict]:
    workdir = tmp_path_factory.mktemp("telemetry")
    agent = AgentSocket(workdir / "agent.sock")
    request_file = workdir / "save-request"
    args = [
        "--ckpt-dir", str(workdir / "ckpt"), "--out-dir", str(workdir / "out"),
        "--steps", str(STEPS), "--ckpt-every", "1000", "--work-ms", "80",
        "--slow-rank", "2", "--slow-factor", "0.3", "--slow-from-step", str(SLOW_FROM_STEP),
        "--straggler-window", str(WINDOW), "--step-deadline-s", str(STEP_DEADLINE_S),
        "--slow-save-s", str(SLOW_SAVE_S), "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
    ]  # fmt: skip
    env = torchrun_env(
        workdir,
        {"SLURMFT_AGENT_SOCKET": str(agent.path), "SLURMFT_SAVE_REQUEST_FILE": str(request_file)},
    )
    process = subprocess.Popen(
        torchrun_command(3, 0, args), cwd=workdir, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    facts: dict[str, Any] = {}
    try:
        wait_for_step(workdir / "out" / "losses.jsonl", 10, process)
        facts["requested_after_step"] = max(
            json.loads(line)["step"]
            for line in (workdir / "out" / "losses.jsonl").read_text().splitlines()
        )
        request_file.touch()  # what the agent does on a time limit or preemption
        rank1 = next(m for m in agent.of("heartbeat") if m["rank"] == 1)
        os.kill(rank1["pid"], signal.SIGUSR2)
        facts["rank1_pid"] = rank1["pid"]
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
        agent.close()
    run = TinyRun(workdir, process.returncode, output)
    assert run.returncode == 0, output[-4000:]
    return run, agent, facts


def test_a_rank_30_percent_slower_is_named_from_the_timings(telemetry_run) -> None:
    run, agent, _ = telemetry_run
    named = run.events("stragglers")
    assert named, "no straggler was named"
    assert all(e["step"] > SLOW_FROM_STEP for e in named), "a rank was named before any slowdown"
    assert [r["rank"] for r in named[0]["ranks"]] == [2]
    assert named[0]["step"] <= SLOW_FROM_STEP + WINDOW + 3
    assert {r["rank"] for e in named for r in e["ranks"]} == {2}
    reports = agent.of("straggler")
    assert reports and {m["straggler_rank"] for m in reports} == {2}
    # Own compute time tells the ranks apart; every rank's step time is the same.
    compute = defaultdict(list)
    total = defaultdict(list)
    for m in agent.of("step"):
        if m["step"] > SLOW_FROM_STEP + 1:
            compute[m["rank"]].append(m["compute_s"])
            total[m["rank"]].append(m["total_s"])
    ratio = statistics.median(compute[2]) / statistics.median(compute[0] + compute[1])
    assert 1.2 < ratio < 1.45, ratio
    step_ratio = statistics.median(total[2]) / statistics.median(total[0] + total[1])
    assert 0.9 < step_ratio < 1.1, step_ratio


def test_a_save_longer_than_the_step_deadline_is_reported_as_checkpointing(telemetry_run) -> None:
    _, agent, _ = telemetry_run
    heartbeats = agent.of("heartbeat")
    long_save = [
        m for m in heartbeats
        if m["phase"] == "checkpoint" and m["progress_age_s"] > 2 * STEP_DEADLINE_S
    ]  # fmt: skip
    assert {m["rank"] for m in long_save} == {0, 1, 2}
    assert not any(m["overdue"] for m in heartbeats), "a phase was reported overdue"
    # Never silent: per rank, heartbeats keep coming through the saves.
    for rank in range(3):
        times = [t for t, m in agent.messages if m["kind"] == "heartbeat" and m["rank"] == rank]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert max(gaps) < 4 * HEARTBEAT_INTERVAL_S + 1.0, max(gaps)


def test_a_save_request_makes_every_rank_save_at_the_same_next_step(telemetry_run) -> None:
    run, agent, facts = telemetry_run
    requested = [e for e in run.events("saved") if e["reason"] == "requested"]
    assert len(requested) == 1
    step = requested[0]["step"]
    # The request lands in the next step's all-reduce at the latest (+1 for a step in flight).
    assert facts["requested_after_step"] < step <= facts["requested_after_step"] + 3
    saved = [m for m in agent.of("event") if m["event"] == "checkpoint_saved" and m["step"] == step]
    assert {m["rank"] for m in saved} == {0, 1, 2}
    manifest = json.loads((run.ckpt_dir / f"step-{step:09d}" / "manifest.json").read_text())
    assert manifest["resume"]["global_step"] == step


def test_sigusr2_dumps_the_rank_s_python_stacks(telemetry_run) -> None:
    run, _, facts = telemetry_run
    dump = run.workdir / "stacks" / f"stacks-rank1-pid{facts['rank1_pid']}.txt"
    text = dump.read_text()
    assert "slurmft-heartbeat" in text or "heartbeat.py" in text
    assert "tiny.py" in text
