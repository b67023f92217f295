"""What a failure cost, from the steps: the true loss, split by cause, adding up to it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from slurmft.core.goodput import Completion, completions, estimate, measure, never_back

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def _t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _rows(steps: range, start_s: float, ranks: int = 4) -> list[tuple[int, datetime, int]]:
    """Every rank ending each step of ``steps``, one a second from ``start_s`` (with the few
    milliseconds the ranks' clocks and reports differ by)."""
    return [
        (step, _t(start_s + i + rank * 0.003), rank)
        for i, step in enumerate(steps)
        for rank in range(ranks)
    ]


# Steps 1-100 end at 1..100 s; the failure is detected at 105 s; training is back with step 91
# (resumed from the checkpoint at step 90) at 125 s, and goes on a step a second.
STEPS = completions([*_rows(range(1, 101), 1.0), *_rows(range(91, 120), 125.0)])


def test_each_run_of_a_step_is_one_completion_at_its_earliest_end() -> None:
    assert len(STEPS) == 100 + 29  # steps 91-100 ran twice
    assert STEPS[0] == Completion(_t(1), 1, ranks=4)
    replays = [c for c in STEPS if c.step == 95]
    assert [c.at for c in replays] == [_t(95), _t(129)]


@pytest.mark.parametrize(("queue_wait_s", "restart_s"), [(0.0, 19.0), (7.0, 12.0)])
def test_a_failure_costs_detection_restart_queue_wait_and_replay(
    queue_wait_s: float, restart_s: float
) -> None:
    lost = measure(STEPS, _t(105), queue_wait_s)
    assert lost is not None
    # The truth: step 101 ends at 135 s, S (100) ended at 100 s, less one step's own time.
    assert lost.total_s == pytest.approx(135 - 100 - 1, abs=0.01)
    assert lost.detection_s == pytest.approx(5, abs=0.01)
    assert lost.replay_s == pytest.approx(10, abs=0.01)  # steps 91-100 again
    assert lost.queue_wait_s == pytest.approx(queue_wait_s)
    assert lost.restart_s == pytest.approx(restart_s, abs=0.01)
    assert (lost.last_step, lost.resumed_from, lost.back_at) == (100, 90, _t(125))
    assert not lost.estimate


def test_training_is_back_only_at_full_world_size() -> None:
    """Back from step 90 at 125 s on 3 of its 4 ranks for ten steps, then on all 4 again from
    step 91 at 140 s: the steps at the smaller world size are lost time too."""
    degraded = [*_rows(range(1, 101), 1.0), *_rows(range(91, 101), 125.0, ranks=3),
                *_rows(range(91, 120), 140.0)]  # fmt: skip
    lost = measure(completions(degraded), _t(105))
    assert lost is not None and lost.back_at == _t(140)
    assert lost.total_s == pytest.approx(150 - 100 - 1, abs=0.01)


def test_a_failure_not_trained_past_yet_is_not_measured() -> None:
    early = completions([*_rows(range(1, 101), 1.0), *_rows(range(91, 99), 125.0)])
    assert measure(early, _t(105)) is None  # back, but not past step 100 yet
    ended = never_back(early, _t(105), _t(200))  # the run ended so: all after S is lost
    assert (ended.total_s, ended.detection_s, ended.last_step) == (100.0, 5.0, 100)


def test_no_part_is_more_than_the_loss() -> None:
    # Reported late (a long queue wait claimed, an in-memory snapshot close to S): the parts
    # are trimmed so they add up to the measured loss.
    lost = measure(STEPS, _t(105), queue_wait_s=500.0)
    assert lost is not None
    assert lost.total_s == pytest.approx(34, abs=0.01)
    assert lost.queue_wait_s == pytest.approx(19, abs=0.01) and lost.restart_s == 0


def test_a_script_without_steps_gets_an_estimate_from_what_is_observable() -> None:
    lost = estimate(_t(105), back_at=_t(125), work_since=_t(60), queue_wait_s=4.0)
    assert lost is not None and lost.estimate
    assert (lost.replay_s, lost.queue_wait_s, lost.restart_s) == (45.0, 4.0, 16.0)
    assert estimate(_t(105), back_at=None, work_since=None) is None
