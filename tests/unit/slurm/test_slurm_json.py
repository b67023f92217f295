"""`--json` documents: v0.0.38 recorded from 22.05.8 here, newer shapes after public examples
(tests/fixtures/slurm/json/README.md says where each comes from)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft.slurm.json_shapes import jobs_from_squeue_json, nodes_from_json, number
from slurmft.slurm.runner import CommandResult
from slurmft.slurm.script import run_id_from_comment
from slurmft.slurm.states import JobState, NodeBase, NodeFlag

JSON_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "slurm" / "json"
Recorded = Callable[[str], CommandResult]


def load(name: str) -> dict[str, Any]:
    return json.loads((JSON_FIXTURES / name).read_text())


def test_recorded_squeue_json_v0_0_38(recorded: Recorded) -> None:
    jobs = jobs_from_squeue_json(json.loads(recorded("squeue_json").stdout))
    by_run = {run_id_from_comment(job.comment): job for job in jobs.values()}
    running = by_run["run-0001"]
    # The batch host n1 was killed: the --no-kill job shrank and still runs.
    assert running.state is JobState.RUNNING
    assert running.batch_host == "n1" and running.nodes == ("n2", "n3")
    held = by_run["rec-held"]
    assert held.state is JobState.PENDING and held.excluded_nodes == ("n5", "n6")
    assert held.reason == "JobHeldUser"
    assert by_run["rec-done"].state is JobState.COMPLETED


def test_recorded_sinfo_json_v0_0_38(recorded: Recorded) -> None:
    nodes = nodes_from_json(json.loads(recorded("sinfo_json").stdout))
    assert set(nodes) == {f"n{i}" for i in range(1, 7)}
    assert nodes["n1"].status.down and nodes["n1"].status.lost
    assert nodes["n1"].reason == "Not responding" and nodes["n1"].reason_user == "root"
    assert nodes["n4"].status.schedulable


def test_squeue_json_v0_0_40_shape() -> None:
    jobs = jobs_from_squeue_json(load("squeue-23.11-data_parser-v0.0.40.json"))
    assert set(jobs) == {"204", "205", "206"}  # job_id plain or wrapped
    assert jobs["204"].state is JobState.RUNNING
    assert jobs["204"].nodes == ("gpu001", "gpu002", "gpu003")
    assert jobs["204"].excluded_nodes == ("gpu007", "gpu009")
    assert (jobs["204"].restarts, jobs["204"].requeue) == (2, True)
    assert jobs["205"].state is JobState.REQUEUED  # ["PENDING", "REQUEUED"]
    assert jobs["205"].batch_host == "" and jobs["205"].reason == "BeginTime"
    assert jobs["206"].state.lost_a_node


def test_nodes_json_v0_0_42_shape() -> None:
    nodes = nodes_from_json(load("nodes-24.11-v0.0.42.json"))
    assert nodes["host1"].status.schedulable
    assert nodes["host2"].status.drained and nodes["host2"].reason_user == "slurmft"
    assert nodes["host2"].reason_time == "1722010273"
    assert nodes["host3"].status.down and NodeFlag.NOT_RESPONDING in nodes["host3"].status.flags
    host4 = nodes["host4"].status
    assert host4.base is NodeBase.MIXED and host4.draining and NodeFlag.COMPLETING in host4.flags


def test_wrapped_numbers() -> None:
    assert number(7) == 7
    assert number({"set": True, "infinite": False, "number": 3}) == 3
    assert number({"set": False, "infinite": False, "number": 0}) is None
    assert number({"set": True, "infinite": True, "number": 0}) is None
    assert number(None) is None and number(True) is None
