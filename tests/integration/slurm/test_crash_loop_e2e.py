"""The crash budget on the real local Slurm cluster, both ways.

- A script that always crashes (rank 1 dies at step 2, before any checkpoint, in every attempt):
  torchrun restarts it in place each time; the daemon counts every failure once, by the
  rendezvous round it ended, and after the configured number of restarts without progress the
  next failure stops the run with the budget's reason. The job is cancelled, and no node is
  drained or denylisted: a crashing script is the user's code, not a node fault.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from daemon_process import DaemonProcess, running_daemon
from e2e_run import TINY, SubmittedRun, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.models import Action, ActionKind, ActionStatus, Event, EventKind
from slurmft.db.records import denied_nodes
from slurmft.db.states import RunState

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

EXAMPLE = ["-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}"]
CAP = 3  # policy.max_restarts_without_progress, lowered from 5 to keep the test short


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with running_daemon(tmp_path, SLURMFT_POLICY_MAX_RESTARTS_WITHOUT_PROGRESS=str(CAP)) as process:
        yield process


def restarts_done(run: SubmittedRun) -> set[str]:
    """Rendezvous rounds torchrun left to restart the workers (every agent of a round reports
    it, naming it)."""
    reports = run.events(Event.kind == EventKind.RESTART, Event.source == "agent")
    named = {e.details.get("rdzv_round") for e in reports}
    assert None not in named, "an agent reported a restart without its round"
    return {str(r) for r in named}


def rounds_first_reported(run: SubmittedRun) -> dict[str, datetime]:
    """When the store first heard of each round's end: a failing rank's collective error or an
    agent's restart, whichever came first (what the daemon counts a restart from)."""
    kinds = (EventKind.RESTART, EventKind.COLLECTIVE_ERROR)
    first: dict[str, datetime] = {}
    for e in run.events(Event.kind.in_(kinds), Event.source == "agent"):
        named = e.details.get("rdzv_round")
        if isinstance(named, str) and (named not in first or e.recorded_at < first[named]):
            first[named] = e.recorded_at
    return first


def restarts_counted(run: SubmittedRun) -> set[str]:
    """The restarts the daemon charged, by the round each ended (its `restart` events)."""
    events = run.events(Event.kind == EventKind.RESTART, Event.source == "daemon")
    return {str(e.details["restart_key"]) for e in events}


def test_a_script_that_always_crashes_stops_at_the_cap_with_the_reason(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    started = time.monotonic()
    script = [*EXAMPLE, *TINY, "--crash-at-step", "2@*", "--fault-rank", "1"]
    run = submit(cluster, daemon, tmp_path, script, name="crash-loop")
    final, _ = wait_for_value(
        "the run to end", run.run, lambda r: r.state.is_terminal, timeout_s=360
    )
    print(f"\ncrash loop stopped after {time.monotonic() - started:.0f} s: {final.end_reason}")

    assert final.state is RunState.STOPPED, final.end_reason
    assert final.end_reason is not None
    assert final.end_reason.startswith(f"crash loop: {CAP} restarts in a row without progress"), (
        final.end_reason
    )
    assert f"the cap is {CAP} (policy.max_restarts_without_progress)" in final.end_reason
    # The stop races torchrun's restarts after the failure that spent the budget: with warm
    # workers a round completes and its workers crash again within a second or so, and the
    # cancel takes up to two of those to land. The restarts the daemon counted before its stop
    # are in the reason after the cap (seen: 2 more); one reported after it is not (seen: the
    # 5th round's restart, its new rendezvous cut short by the cancel's SIGTERM). The loop is
    # bounded either way: never more than two restarts past the one that spent the budget.
    later = final.restarts_without_progress - (CAP + 1)
    assert 0 <= later <= 2, final.restarts_without_progress
    assert final.end_reason.endswith(f"; {later} more before the stop took effect") == (later > 0)
    counted = restarts_counted(run)
    assert len(counted) == final.restarts_without_progress, sorted(counted)
    first_reported = rounds_first_reported(run)
    assert counted <= first_reported.keys(), (sorted(counted), sorted(first_reported))
    done = restarts_done(run)
    assert CAP <= len(done) <= CAP + 3, run.job_log()[-3000:]
    # A round the daemon did not count is one it first heard of after all those it counted.
    newest_counted = max(first_reported[r] for r in counted)
    late = {r: first_reported[r] for r in done - counted}
    assert all(at >= newest_counted for at in late.values()), (newest_counted, late)
    starts = [e for e in run.jsonl("events.jsonl") if e["event"] == "fresh_start"]
    # Never a checkpoint: every start is from scratch (a racing last round may not get to it).
    assert CAP + 1 <= len(starts) <= len(done) + 1, (len(starts), len(done))
    assert max(r["step"] for r in run.jsonl("losses.jsonl")) == 2

    (stop,) = run.actions(Action.kind == ActionKind.STOP_RUN)
    assert (stop.status, stop.reason) == (ActionStatus.DONE, final.end_reason)
    wait_for_value(
        "the job to be gone from Slurm",
        lambda: cluster.client.job(run.job_id).state,
        lambda state: state.is_ended,
        timeout_s=60,
    )
    # The user's code, not a node: nothing left the run, nothing was drained.
    removals = {ActionKind.AGENT_LEAVE, ActionKind.DRAIN_NODE, ActionKind.EVICT_NODE}
    assert not [a.reason for a in run.actions() if a.kind in removals]
    with run.database.session() as s:
        assert not denied_nodes(s) and not denied_nodes(s, run_id=run.run_id)
    assert not [n for n, info in cluster.client.nodes().items() if info.status.drain_requested]
    run.database.dispose()
