"""Numerical faults under `slurmft submit` on the real local Slurm cluster, with the daemon.

Sample 7 of the example's data is NaN. Under `skip` the run drops the global batch that holds
it and completes with finite losses; the store names the sample and the step (a numerical
fault), and a NaN injected once on rank 1 (finite when re-run) is stored as a suspected
hardware fault of rank 1's node. Under `stop` the daemon stops the run with the step in its
reason, and nothing is resubmitted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from e2e_run import EXAMPLE, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.models import Event, EventKind, FaultClass
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

POISON = ["--poison-index", "7", "--steps", "40", "--ckpt-every", "10", "--work-ms", "100"]


def test_skip_completes_naming_the_sample_and_a_nan_once_is_the_nodes(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(
        cluster, daemon, tmp_path,
        [*EXAMPLE, *POISON, "--numerical-policy", "skip", "--nan-once-at-step", "5",
         "--fault-rank", "1"],
        name="numerical-skip", nodes=2, spares=0,
    )  # fmt: skip
    final, _ = wait_for_value("the run to end", run.run, lambda r: r.state.is_terminal, 240)
    assert final.state is RunState.COMPLETED, run.job_log()[-3000:]
    faults = run.events(Event.kind == EventKind.NUMERICAL_FAULT)
    data = [e for e in faults if e.fault_class is FaultClass.NUMERICAL]
    suspect = [e for e in faults if e.fault_class is FaultClass.HARDWARE]
    assert [(e.details["samples"], e.details["action"]) for e in data] == [([7], "skip")]
    skipped = data[0].details["step"]
    assert f"at step {skipped}" in data[0].message and "skipped" in data[0].message
    assert [(e.rank, e.details["step"]) for e in suspect] == [(1, 5)]
    assert suspect[0].node == run.beating_nodes()[1]  # the node rank 1 trained on
    records = run.jsonl("losses.jsonl")
    assert all(math.isfinite(r["loss"]) for r in records)
    assert sorted({r["step"] for r in records}) == [s for s in range(1, 41) if s != skipped]
    run.database.dispose()


def test_stop_stops_the_run_with_the_step_and_resubmits_nothing(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(
        cluster, daemon, tmp_path, [*EXAMPLE, *POISON, "--numerical-policy", "stop"],
        name="numerical-stop", nodes=2, spares=0,
    )  # fmt: skip
    final, _ = wait_for_value("the run to end", run.run, lambda r: r.state.is_terminal, 240)
    assert final.state is RunState.STOPPED, run.job_log()[-3000:]
    (first, *_) = run.events(Event.kind == EventKind.NUMERICAL_FAULT)
    step = first.details["step"]
    assert final.end_reason == first.message
    assert f"non-finite loss at step {step}" in final.end_reason
    assert "policy stop" in final.end_reason
    assert max(r["step"] for r in run.jsonl("losses.jsonl")) == step - 1
    assert len(run.attempts()) == 1  # never resubmitted
    run.database.dispose()
