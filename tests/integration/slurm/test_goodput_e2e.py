"""Goodput measured against the truth, on the real local Slurm cluster.

One run of the example (3 nodes + 1 spare) goes through three failures: an active node killed
(the spare takes over), rank 1's worker frozen with SIGSTOP (the daemon finds it silent and its
workers restart), and the batch host killed (the job is requeued without it). The truth for each
comes from the example's own step log, where rank 0 writes when each step ended: the loss is
t(first completion of a step > S) - t(S) - the median step, S being the last step completed
before it; the replay is S minus the step resumed from, times the median step. The detection is
from S to when the failure was struck (the test's clock), plus the time its detector is meant to
take (none for a killed node, whose peers' collectives fail at once; `policy.silent_after_s` for
a frozen rank); the restart (with any queue wait) is the rest. A node kill lands somewhere while
`slurm-cluster kill-node` runs (it lists the node's processes in /proc first, which takes longer
on a busy machine): its strike is that window, and the truth of the detection and the restart
are ranges with it. What the daemon recorded must be within max(2 s, 10 %) of each, and the
run's effective ratio within 0.01; a miss prints the run's reports timed from S.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from daemon_process import DaemonProcess, running_daemon
from e2e_run import SubmittedRun, submit, worker_pid
from local_cluster import Cluster
from sqlalchemy import func, select, text
from support.waiting import wait_for_value

from slurmft.db.models import Event, EventKind, Run, StepTime
from slurmft.db.states import AttemptState, RunState

# serial: the hang is found by a rank's silence, which load from other tests also causes.
pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.serial]

# Each failure is struck late in a checkpoint interval, so that its replay alone costs 15 s
# (the cheapest case this test means to measure): 50 steps of 0.3 s at least. A node kill
# recovers in about 2 s (warm workers, the dead-peer detector), so its detection and restart
# cannot be counted on for any of it (struck at step 42 of 50, one cost 14.9 s in all). The
# strikes land at steps 50-55, 110-115 and 170-175 (each after the last one's recovery): 200
# steps leave the run some 25 after the last, 80 after the checkpoint it resumes from.
CKPT_EVERY, STRIKE_FROM = 60, 50
EXAMPLE = [
    "-m", "slurmft.train.examples.tiny", "--ckpt-dir", "{ckpt}", "--out-dir", "{out}",
    "--steps", "200", "--ckpt-every", str(CKPT_EVERY), "--work-ms", "300",
    "--heartbeat-interval-s", "1", "--pg-timeout-s", "30",
]  # fmt: skip
OUTAGES = (EventKind.NODE_LOST, EventKind.HANG, EventKind.BATCH_HOST_DOWN)
SILENT_AFTER_S = 10.0
# How long each outage's detector is meant to take after the strike.
DETECTOR_S = {EventKind.NODE_LOST: 0.0, EventKind.HANG: SILENT_AFTER_S,
              EventKind.BATCH_HOST_DOWN: 0.0}  # fmt: skip


@dataclass(frozen=True)
class TrueLoss:
    last_step: int  # S
    last_step_at: float  # when S ended (the step log's clock)
    resumed_from: int
    lost_s: float
    replay_s: float


def true_losses(records: list[dict[str, Any]]) -> tuple[list[TrueLoss], float, float]:
    """Each failure in the step log (a step run again, or a pause far longer than a step), the
    median step, and the wall time from the first step's start to the last one's end."""
    deltas = [
        b["time"] - a["time"] for a, b in itertools.pairwise(records) if b["step"] == a["step"] + 1
    ]
    median = statistics.median(deltas)
    found = []
    for i in range(1, len(records)):
        before, after = records[i - 1], records[i]
        paused = after["time"] - before["time"] > 10 * median
        if after["step"] <= before["step"] or paused:
            s = max(r["step"] for r in records[:i])
            t_s = max(r["time"] for r in records[:i] if r["step"] == s)
            beyond = next(r for r in records[i:] if r["step"] > s)
            resumed = after["step"] - 1
            lost_s = beyond["time"] - t_s - median
            found.append(TrueLoss(s, t_s, resumed, lost_s, (s - resumed) * median))
    wall = records[-1]["time"] - (records[0]["time"] - median)
    return found, median, wall


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with running_daemon(tmp_path, SLURMFT_POLICY_SILENT_AFTER_S=str(SILENT_AFTER_S)) as process:
        yield process


def _wait_to_strike(run: SubmittedRun, after_step: int) -> None:
    """Until training is past ``after_step`` and late in a checkpoint interval."""
    wait_for_value(
        f"training past step {after_step}, late in a checkpoint interval",
        run.latest_step,
        lambda step: step > after_step and STRIKE_FROM <= step % CKPT_EVERY < CKPT_EVERY - 4,
        timeout_s=240,
    )


@dataclass(frozen=True)
class Strike:
    """When a failure was struck: somewhere between ``began`` and ``landed`` (test's clock)."""

    began: float
    landed: float


def _killed(cluster: Cluster, node: str) -> Strike:
    began = time.time()
    cluster.kill_node(node)
    return Strike(began, time.time())


def _node_killed(cluster: Cluster, run: SubmittedRun) -> Strike:
    """Kills an active node that is not the batch host."""
    batch_host = cluster.client.job(run.job_id).batch_host
    victim = sorted(set(run.beating_nodes().values()) - {batch_host})[0]
    struck = _killed(cluster, victim)
    run.wait_replaced(victim)
    return struck


def _rank_frozen(run: SubmittedRun) -> Strike:
    pid = worker_pid(run, 1)
    struck = time.time()
    os.kill(pid, signal.SIGSTOP)
    wait_for_value(
        "the daemon to find rank 1 silent",
        lambda: run.events(Event.kind == EventKind.HANG, Event.source == "daemon"),
        bool,
        timeout_s=90,
    )
    return Strike(struck, struck)


def _batch_host_killed(cluster: Cluster, run: SubmittedRun) -> Strike:
    struck = _killed(cluster, cluster.client.job(run.job_id).batch_host)
    wait_for_value(
        "the job requeued and running again",
        run.attempts,
        lambda found: len(found) == 2 and found[1].state is AttemptState.RUNNING,
        timeout_s=150,
    )
    return struck


def _recorded(run: SubmittedRun) -> list[Event]:
    """The outages' heads: the reports the daemon put each outage's cost on."""
    heads = run.events(Event.kind.in_(OUTAGES), Event.time_lost_s.is_not(None))
    return sorted((e for e in heads if e.time_lost_s), key=lambda e: e.occurred_at)


def _span(bounds: tuple[float, float]) -> str:
    low, high = bounds
    return f"{low:.1f}" if high - low < 0.05 else f"{low:.1f} to {high:.1f}"


def _timeline(run: SubmittedRun, truth: list[TrueLoss]) -> list[str]:
    """The run's reports, each timed from the newest failure's S before it."""
    lines = []
    for event in sorted(run.events(), key=lambda e: e.occurred_at):
        at = event.occurred_at.replace(tzinfo=UTC).timestamp()
        s = max((t.last_step_at for t in truth if t.last_step_at <= at), default=None)
        since = f"S+{at - s:.2f} s" if s is not None else "before S"
        lines.append(f"{since}: {event.kind.value} from {event.source} {event.node or ''}: "
                     f"{(event.message or '')[:100]}")  # fmt: skip
    return lines


def _span_behind_s(run: SubmittedRun) -> float:
    """How far the run's stored last step time is behind its newest step time."""
    with run.database.session() as s:
        stored = s.get(Run, run.run_id)
        newest = s.scalar(select(func.max(StepTime.ended_at)).where(StepTime.run_id == run.run_id))
        assert stored is not None and newest is not None
        last = stored.last_step_at
        return (newest - last).total_seconds() if last is not None else float("inf")


def test_three_failures_cost_what_the_step_log_says(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    run = submit(cluster, daemon, tmp_path, EXAMPLE, name="goodput")
    run.wait_training(past_step=5)
    _wait_to_strike(run, 0)
    struck = [_node_killed(cluster, run)]
    _wait_to_strike(run, run.latest_step() + 12)
    struck.append(_rank_frozen(run))
    _wait_to_strike(run, run.latest_step() + 12)
    struck.append(_batch_host_killed(cluster, run))
    wait_for_value("the run to complete", lambda: run.run().state,
                   lambda state: state is RunState.COMPLETED, timeout_s=300)  # fmt: skip

    records = run.jsonl("losses.jsonl")
    truth, median, wall = true_losses(records)
    recorded, _ = wait_for_value(
        "the daemon to measure the three outages",
        lambda: _recorded(run),
        lambda heads: len(heads) >= 3,
        timeout_s=60,
    )
    assert len(truth) == len(recorded) == 3, (truth, [(e.kind, e.time_lost_s) for e in recorded])
    report = []
    for true, event, at in zip(truth, recorded, struck, strict=True):
        assert true.lost_s >= 15, f"a failure cheaper than the test means: {true}"
        assert event.kind in DETECTOR_S, event.kind
        # Each truth as (earliest, latest): the strike's window carried through.
        detector_s = DETECTOR_S[event.kind]
        detection = (at.began - true.last_step_at + detector_s,
                     at.landed - true.last_step_at + detector_s)  # fmt: skip
        rest = true.lost_s - true.replay_s
        restart = (rest - detection[1], rest - detection[0])  # with any queue wait
        assert event.lost_restart_s is not None and event.lost_queue_wait_s is not None
        report.append(f"{event.kind.value}: recorded {event.time_lost_s:.1f} s (detection "
                      f"{event.lost_detection_s:.1f}, restart {event.lost_restart_s:.1f}, queue "
                      f"{event.lost_queue_wait_s:.1f}, replay {event.lost_replay_s:.1f}), true "
                      f"{true.lost_s:.1f} s (detection {_span(detection)}, restart and queue "
                      f"{_span(restart)}, replay {true.replay_s:.1f}); the strike took "
                      f"{at.landed - at.began:.2f} s")  # fmt: skip
        for figure, (low, high) in (
            (event.time_lost_s, (true.lost_s, true.lost_s)),
            (event.lost_detection_s, detection),
            (event.lost_restart_s + event.lost_queue_wait_s, restart),
            (event.lost_replay_s, (true.replay_s, true.replay_s)),
        ):
            margin = max(2.0, 0.1 * high)
            assert low - margin <= figure <= high + margin, "\n".join(
                [*report, *_timeline(run, truth)]
            )
        assert event.time_lost_estimate is False
        assert event.details["goodput"]["last_step"] == true.last_step
    assert recorded[2].lost_queue_wait_s is not None and recorded[2].lost_queue_wait_s >= 0

    # The wall runs to the newest step end the goodput pass has read: within a pass of the end.
    wait_for_value("the daemon to read the run's last step", lambda: _span_behind_s(run),
                   lambda behind: behind == 0, timeout_s=30)  # fmt: skip
    true_ratio = 1 - sum(t.lost_s for t in truth) / wall
    with run.database.session() as s:
        row = s.execute(
            text("SELECT wall_s, effective_ratio FROM run_effective_time WHERE run_id = :r"),
            {"r": run.run_id},
        ).one()
    assert float(row.effective_ratio) == pytest.approx(true_ratio, abs=0.01), (row, true_ratio)
    assert float(row.wall_s) == pytest.approx(wall, abs=2.0)
    print("\n" + "\n".join(report) + f"\nmedian step {median:.3f} s; effective ratio recorded "
          f"{float(row.effective_ratio):.4f}, true {true_ratio:.4f}")  # fmt: skip
    run.database.dispose()


PLAIN_CKPT_EVERY = 30


def test_a_plain_scripts_failure_gets_an_estimate_near_the_truth(
    cluster: Cluster, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A script without slurmft.train reports no steps: its node loss gets an estimate (marked
    so) from the failure's report, its ranks' restart and its checkpoint files, within
    max(5 s, 25 %) of what its own step log says."""
    plain = str(Path(__file__).parents[3] / "slurmft" / "train" / "examples" / "plain.py")
    # 100 steps: the strike lands near step 50, and the run then replays from 30 and ends.
    argv = [plain, "--ckpt-dir", "{ckpt}", "--out-dir", "{out}", "--steps", "100",
            "--ckpt-every", str(PLAIN_CKPT_EVERY), "--work-ms", "300",
            "--pg-timeout-s", "30"]  # fmt: skip
    run = submit(cluster, daemon, tmp_path, argv, name="plain-goodput")
    steps = lambda: [r["step"] for r in run.jsonl("steps.jsonl")]  # noqa: E731
    wait_for_value(
        "the plain script late in its second checkpoint interval or later",
        lambda: (steps() or [0])[-1],
        lambda step: step > PLAIN_CKPT_EVERY and 20 <= step % PLAIN_CKPT_EVERY < 26,
        timeout_s=240,
    )
    batch_host = cluster.client.job(run.job_id).batch_host
    # An active node (the script reports nothing: its own starts.jsonl says where ranks run).
    active = {start["node"] for start in run.jsonl("starts.jsonl")}
    victim = sorted(active - {batch_host})[0]
    cluster.kill_node(victim)
    wait_for_value("the run to complete", lambda: run.run().state,
                   lambda state: state is RunState.COMPLETED, timeout_s=300)  # fmt: skip
    truth, _, _ = true_losses(run.jsonl("steps.jsonl"))
    (recorded,), _ = wait_for_value(
        "the daemon to estimate the outage",
        lambda: _recorded(run),
        lambda heads: len(heads) == 1,
        timeout_s=60,
    )
    (true,) = truth
    print(f"\nplain: estimated {recorded.time_lost_s:.1f} s (restart {recorded.lost_restart_s:.1f}"
          f", replay {recorded.lost_replay_s:.1f}), true {true.lost_s:.1f} s")  # fmt: skip
    assert recorded.time_lost_estimate is True
    assert recorded.time_lost_s == pytest.approx(true.lost_s, abs=max(5.0, 0.25 * true.lost_s))
    run.database.dispose()
