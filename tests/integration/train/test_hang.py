"""A rank that stops calling collectives (world size 3, gloo): its heartbeats say it is overdue in
`step`, SIGUSR2 shows where it is stuck, its peers time out and exit, torchrun restarts, and the
run resumes from the last checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from tiny_runs import RUN_TIMEOUT_S, AgentSocket, TinyRun, torchrun_command, torchrun_env

pytestmark = [pytest.mark.torch, pytest.mark.serial]  # 1 s step deadline, 5 s collective timeout

PG_TIMEOUT_S = 5
STEP_DEADLINE_S = 1.0


def test_a_hung_rank_is_overdue_its_peers_time_out_and_the_run_resumes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    workdir = tmp_path_factory.mktemp("hang")
    agent = AgentSocket(workdir / "agent.sock")
    args = [
        "--ckpt-dir", str(workdir / "ckpt"), "--out-dir", str(workdir / "out"),
        "--steps", "8", "--ckpt-every", "4", "--hang-at-step", "5@0", "--fault-rank", "1",
        "--pg-timeout-s", str(PG_TIMEOUT_S), "--step-deadline-s", str(STEP_DEADLINE_S),
        "--heartbeat-interval-s", "0.25",
    ]  # fmt: skip
    env = torchrun_env(workdir, {"SLURMFT_AGENT_SOCKET": str(agent.path)})
    process = subprocess.Popen(
        torchrun_command(3, 1, args), cwd=workdir, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    dumped_pid = None
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while dumped_pid is None and time.monotonic() < deadline and process.poll() is None:
            overdue = [m for m in agent.of("heartbeat") if m["overdue"] and m["section"] != "wait"]
            if overdue:  # what the agent does: collect evidence from the stuck rank
                dumped_pid = overdue[0]["pid"]
                os.kill(dumped_pid, signal.SIGUSR2)
            time.sleep(0.05)
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
        agent.close()
    run = TinyRun(workdir, process.returncode, output)
    assert run.returncode == 0, output[-4000:]

    overdue = [m for m in agent.of("heartbeat") if m["overdue"]]
    assert overdue, "the hung rank was never reported overdue"
    # Its peers become overdue too, but inside the collective waiting for it: victims.
    suspects = {(m["rank"], m["phase"], m["step"]) for m in overdue if m["section"] != "wait"}
    victims = {(m["rank"], m["step"]) for m in overdue if m["section"] == "wait"}
    assert suspects == {(1, "step", 5)}
    assert victims <= {(0, 5), (2, 5)}
    assert {m["restart_count"] for m in overdue} == {0}
    # Its peers were stopped by the collective timeout (not by torchrun), with the fast exit.
    assert "slurmft: collective error, exiting with 75" in output
    first_overdue = min(t for t, m in agent.messages if m["kind"] == "heartbeat" and m["overdue"])
    restarted = min(t for t, m in agent.messages if m["restart_count"] == 1)
    assert restarted - first_overdue < PG_TIMEOUT_S + 30

    stacks = (workdir / "stacks" / f"stacks-rank1-pid{dumped_pid}.txt").read_text()
    assert "hang_forever" in stacks

    (resumed,) = run.events("resumed")
    assert (resumed["attempt"], resumed["step"]) == (1, 4)
    assert sorted(run.steps()) == list(range(1, 9))
