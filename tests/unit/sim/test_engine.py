"""The simulator: exact on a case with a closed form, driven by the real policy, its time
accounted for to the second."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import slurmft.controller.decide as policy
from slurmft.controller.views import Action, ClusterView, RequeueJob
from slurmft.sim.engine import simulate
from slurmft.sim.inputs import DAY, HOUR, FailureRates, Hit, Inputs, Strategy

SIM = Path(policy.__file__).resolve().parents[1] / "sim"


def closed_form(
    span: float, every: float, interval: float, cost: float, recovery: float
) -> dict[str, float]:
    """One node, a software failure every ``every`` seconds from the first step, restarted in
    place in ``recovery``; a checkpoint after each ``interval`` of training blocks ``cost``.
    Each stretch of training starts from a checkpoint: k whole cycles of interval + cost, then
    a remainder r; a failure replays min(r, interval) and loses the unfinished checkpoint's
    r - interval; at the horizon the remainder's steps count."""
    effective = replay = checkpoint = restart = 0.0
    t, first = 0.0, True
    while t < span:
        if not first:
            restart += min(recovery, span - t)
            t += recovery
        end_by_failure = t - (0.0 if first else recovery) + every <= span
        stretch_end = (t - (0.0 if first else recovery) + every) if end_by_failure else span
        length = max(0.0, stretch_end - t)
        k = math.floor(length / (interval + cost))
        r = length - k * (interval + cost)
        effective += k * interval
        checkpoint += k * cost + max(0.0, r - interval)
        if end_by_failure:
            replay += min(r, interval)
        else:
            effective += min(r, interval)
        t, first = stretch_end, False
    return {"effective": effective, "replay": replay, "checkpoint": checkpoint, "restart": restart}


@pytest.mark.parametrize(
    ("every", "interval", "cost", "recovery", "span"),
    [
        (3600.0, 600.0, 30.0, 60.0, 2 * DAY),
        (1000.0, 170.0, 3.0, 45.0, 1 * DAY + 123.0),
        (777.7, 100.0, 0.78, 61.3, 3 * DAY),  # failures land inside checkpoints too
    ],
)
def test_one_node_matches_the_closed_form(
    every: float, interval: float, cost: float, recovery: float, span: float
) -> None:
    startup = 300.0
    inputs = Inputs(
        nodes=1,
        spares=0,
        strategy=Strategy.LADDER,
        horizon_s=startup + span,
        failure_every_s=every,
        failure_every_hit=Hit.SOFTWARE,
        checkpoint_interval_s=interval,
        checkpoint_cost_s=cost,
        restart_in_place_s=recovery,
        job_startup_s=startup,
    )
    result = simulate(inputs)
    want = closed_form(span, every, interval, cost, recovery)
    lost = result.lost_s()
    assert result.ledger.span_s == pytest.approx(span, abs=1e-9)
    assert result.ledger.effective_s == pytest.approx(want["effective"], abs=1e-9 * span)
    assert lost.get("replay", 0.0) == pytest.approx(want["replay"], abs=1e-9 * span)
    assert lost.get("checkpoint", 0.0) == pytest.approx(want["checkpoint"], abs=1e-9 * span)
    assert lost.get("restart", 0.0) == pytest.approx(want["restart"], abs=1e-9 * span)
    assert result.ettr == pytest.approx(want["effective"] / span, abs=1e-9)
    assert result.counts.stops == 0  # each stretch checkpoints: progress, never a crash loop


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("spares", [0, 4])
def test_every_second_is_accounted_for(strategy: Strategy, spares: int) -> None:
    inputs = Inputs(nodes=128, spares=spares, strategy=strategy, seed=7, horizon_s=3 * DAY,
                    rates=_rates(30.0), crash_loop_share=0.3, stragglers_per_node_day=0.02,
                    pool_nodes=64, repair_s=6 * HOUR)  # fmt: skip
    result = simulate(inputs)
    ledger = result.ledger
    assert ledger.effective_s + sum(ledger.lost.values()) == pytest.approx(ledger.span_s, rel=1e-12)
    assert sum(result.counts.interruptions.values()) > 20  # the failures did hit it
    assert 0.0 < result.ettr < 1.0
    assert ledger.startup_s == pytest.approx(inputs.job_startup_s)


def _rates(scale: float) -> FailureRates:
    table = FailureRates.llama3()
    return FailureRates(
        per_node_hour={k: v * scale for k, v in table.per_node_hour.items()}, hits=table.hits
    )


def test_the_simulator_follows_the_policy_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    rates = FailureRates(per_node_hour={"Xid 79": 1 / 64 / 6}, hits={"Xid 79": Hit.GPU})
    inputs = Inputs(nodes=64, spares=0, seed=3, horizon_s=2 * DAY, rates=rates, pool_nodes=16)
    real = simulate(inputs)
    assert real.counts.requeues > 3  # without spares, a GPU fault is requeued by the policy

    def never_requeue(view: ClusterView, p: policy.Policy) -> list[Action]:
        return [a for a in real_decide(view, p) if not isinstance(a, RequeueJob)]

    real_decide = policy.decide
    monkeypatch.setattr(policy, "decide", never_requeue)
    changed = simulate(inputs)
    assert changed.counts.requeues == 0
    assert changed.ettr < real.ettr - 0.2  # the first GPU fault now stalls the run for good


def test_spares_replace_lost_nodes_without_a_requeue() -> None:
    rates = FailureRates(per_node_hour={"host": 1 / 64 / 12}, hits={"host": Hit.NODE})
    base = Inputs(nodes=64, seed=5, horizon_s=DAY, rates=rates, stragglers_per_node_day=0.0)
    none = simulate(base.with_(spares=0))
    many = simulate(base.with_(spares=8))
    assert none.counts.requeues >= 1 and many.counts.spares_used >= 1
    assert many.counts.requeues < none.counts.requeues
    assert many.lost_s().get("queue", 0.0) < none.lost_s().get("queue", 0.0)


def test_a_slow_batch_host_hands_its_place_to_a_spare() -> None:
    """The batch host turns straggler: the policy excludes it once a spare exists, a spare
    trains in its place and the batch step runs on; nothing waits for a requeue."""
    inputs = Inputs(nodes=8, spares=2, seed=1, horizon_s=DAY, failure_every_s=6 * HOUR,
                    failure_every_hit=None, straggler_slowdown=0.5)  # fmt: skip
    result = simulate(inputs)
    assert result.counts.spares_used == 2 and result.counts.requeues == 0
    assert result.lost_s().get("detection", 0.0) == 0.0
    assert result.ettr > 0.98


def test_the_simulator_defines_no_policy_of_its_own() -> None:
    """Every action the ladder applies comes from decide: the simulator constructs none, and
    defines no decide (import-linter keeps it from calling the detectors itself)."""
    actions = {
        name
        for name in dir(__import__("slurmft.controller.views", fromlist=["x"]))
        if isinstance(getattr(policy, name, None), type)
        and issubclass(getattr(policy, name), Action)
    }
    assert {"RequeueJob", "ExcludeNode", "DrainNode"} <= actions
    for path in sorted(SIM.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in actions, f"{path.name} builds a {node.func.id}"
            if isinstance(node, ast.FunctionDef):
                assert node.name != "decide", f"{path.name} defines decide"
