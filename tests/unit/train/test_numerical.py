"""The numerical guard on one process: a fault a re-run reproduces is the data's (the policy
applies, the bad samples are named), one it does not is the node's; the re-run sees the step's
RNG again; `off` checks nothing; a `record` episode is reported once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slurmft.train.numerical import NumericalGuard, NumericalPolicy

pytestmark = pytest.mark.torch


class Sent:
    """A report channel that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def send(self, kind: str, **fields: Any) -> bool:
        self.events.append({"kind": kind, **fields})
        return True


def _bad(values: torch.Tensor, indices: list[int]) -> list[int]:
    return [i for i, ok in zip(indices, torch.isfinite(values).tolist(), strict=True) if not ok]


def test_a_poisoned_sample_reproduces_and_is_named() -> None:
    sent = Sent()
    guard = NumericalGuard(sent, "skip")  # type: ignore[arg-type]
    data = torch.ones(4)
    data[2] = float("nan")
    guard.begin_step()
    verdict = guard.check(5, _bad(data, [10, 11, 12, 13]), lambda: _bad(data, [10, 11, 12, 13]))
    assert verdict is not None and verdict.reproduced and not verdict.use_rerun
    assert (verdict.samples, verdict.action) == ((12,), "skip")
    (event,) = sent.events
    assert event["event"] == "numerical_fault" and event["reproduced"] is True
    assert (
        event["samples"] == [12] and "policy skip: the global batch was skipped" in event["summary"]
    )


def test_a_fault_gone_on_the_rerun_is_the_nodes_and_the_rerun_sees_the_same_rng() -> None:
    sent = Sent()
    guard = NumericalGuard(sent, "stop")  # type: ignore[arg-type]
    torch.manual_seed(3)
    guard.begin_step()
    first = torch.rand(3)  # what the step drew (its dropout, say)
    drawn: list[torch.Tensor] = []

    def rerun() -> list[int]:
        drawn.append(torch.rand(3))
        return []

    verdict = guard.check(9, [-1], rerun)
    assert verdict is not None and not verdict.reproduced and verdict.use_rerun
    assert verdict.action == "continue"  # not the policy's: the node, not the data
    assert torch.equal(drawn[0], first)  # the re-run drew the very same numbers
    assert (
        sent.events[0]["reproduced"] is False and "suspected hardware" in sent.events[0]["summary"]
    )


def test_off_checks_nothing_and_a_finite_step_is_no_verdict() -> None:
    sent = Sent()
    assert NumericalGuard(sent, NumericalPolicy.OFF).check(1, [3], lambda: [3]) is None
    guard = NumericalGuard(sent, "record")  # type: ignore[arg-type]
    guard.begin_step()
    assert guard.check(1, [], lambda: pytest.fail("no re-run for a finite step")) is None
    assert sent.events == []


def test_a_record_episode_is_reported_once_until_a_finite_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURMFT_NUMERICAL_POLICY", "record")
    sent = Sent()
    guard = NumericalGuard(sent)  # type: ignore[arg-type]
    reruns = []
    for step, bad in ((1, [5]), (2, [6]), (3, [7]), (4, []), (5, [8])):
        guard.begin_step()
        guard.check(step, bad, lambda bad=bad: reruns.append(1) or bad)
    assert [e["step"] for e in sent.events] == [1, 5]  # 2 and 3 were the same episode
    assert len(reruns) == 2
