from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from slurmft.controller.detect import (
    HangKind,
    RankBeat,
    RankCompute,
    find_hangs,
    find_stragglers,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _beat(
    rank: int, *, ago: float = 1.0, phase: str = "step", age: float = 2.0, deadline: float = 300.0
) -> RankBeat:
    return RankBeat(
        rank=rank,
        node=f"n{rank + 1}",
        phase=phase,
        step=100,
        received_at=NOW - timedelta(seconds=ago),
        progress_age_s=age,
        deadline_s=deadline,
    )


def test_healthy_run_has_no_findings() -> None:
    assert find_hangs([_beat(r) for r in range(4)], now=NOW, silent_after_s=30) == ([], None)


def test_plain_script_without_heartbeats_is_never_a_hang() -> None:
    assert find_hangs([], now=NOW, silent_after_s=30) == ([], None)


def test_rank_stuck_in_a_collective_is_overdue() -> None:
    beats = [_beat(0), _beat(1, age=301.0), _beat(2)]
    findings, silence = find_hangs(beats, now=NOW, silent_after_s=30)
    assert silence is None
    assert [(f.rank, f.kind, f.phase) for f in findings] == [(1, HangKind.OVERDUE, "step")]
    assert findings[0].reason == "slurmft: hang rank 1 no progress in step for 301s (deadline 300s)"


def test_long_checkpoint_within_its_deadline_is_not_a_hang() -> None:
    beats = [_beat(r, phase="checkpoint", age=900.0, deadline=1800.0) for r in range(3)]
    assert find_hangs(beats, now=NOW, silent_after_s=30) == ([], None)


def test_frozen_rank_while_peers_report() -> None:
    beats = [_beat(0), _beat(1, ago=45.0), _beat(2)]
    findings, silence = find_hangs(beats, now=NOW, silent_after_s=30)
    assert silence is None
    assert [(f.rank, f.kind, round(f.seconds)) for f in findings] == [(1, HangKind.FROZEN, 45)]


def test_a_rank_that_said_it_is_done_is_not_frozen_while_slower_peers_report() -> None:
    beats = [_beat(0, ago=45.0, phase="done"), _beat(1), _beat(2)]
    assert find_hangs(beats, now=NOW, silent_after_s=30) == ([], None)
    # Every rank done and quiet: the run ended, not the report channel.
    done = [_beat(r, ago=120.0, phase="done") for r in range(3)]
    assert find_hangs(done, now=NOW, silent_after_s=30) == ([], None)


def test_whole_run_silent_is_the_channel_not_a_hang() -> None:
    beats = [_beat(r, ago=120.0 + r, age=500.0) for r in range(3)]
    findings, silence = find_hangs(beats, now=NOW, silent_after_s=30)
    assert findings == []
    assert silence is not None and silence.ranks == 3 and silence.seconds == pytest.approx(120)


def _compute(rank: int, values: list[float], group: str = "") -> RankCompute:
    return RankCompute(rank=rank, node=f"n{rank // 2 + 1}", buckets=tuple(values), peer_group=group)


@pytest.mark.parametrize(
    ("name", "ranks", "flagged"),
    [
        (
            "rank 1 slowed 30% in every bucket",
            [
                _compute(0, [1.0] * 5),
                _compute(1, [1.3] * 5),
                _compute(2, [1.0] * 5),
                _compute(3, [1.02] * 5),
            ],
            [1],
        ),
        (
            "two ranks only: the slow one still stands out",
            [_compute(0, [1.0] * 5), _compute(1, [1.3] * 5)],
            [1],
        ),
        (
            "one slow bucket is noise",
            [
                _compute(0, [1.0] * 5),
                _compute(1, [1.0, 1.0, 1.6, 1.0, 1.0]),
                _compute(2, [1.0] * 5),
            ],
            [],
        ),
        (
            "just under the threshold",
            [_compute(0, [1.0] * 5), _compute(1, [1.19] * 5), _compute(2, [1.0] * 5)],
            [],
        ),
        (
            "not a whole window yet",
            [_compute(0, [1.0] * 2), _compute(1, [1.5] * 2), _compute(2, [1.0] * 2)],
            [],
        ),
        (
            "pipeline stages differ by design: compared within their group",
            [
                _compute(0, [1.0] * 5, "s0"),
                _compute(1, [1.0] * 5, "s0"),
                _compute(2, [2.0] * 5, "s1"),
                _compute(3, [2.0] * 5, "s1"),
            ],
            [],
        ),
        (
            "a slow rank inside one stage",
            [
                _compute(0, [1.0] * 5, "s0"),
                _compute(1, [1.0] * 5, "s0"),
                _compute(2, [2.0] * 5, "s1"),
                _compute(3, [2.8] * 5, "s1"),
                _compute(4, [2.0] * 5, "s1"),
            ],
            [3],
        ),
        (
            "a lone rank in its group is never flagged",
            [_compute(0, [9.0] * 5, "solo"), _compute(1, [1.0] * 5)],
            [],
        ),
    ],
)
def test_straggler_table(name: str, ranks: list[RankCompute], flagged: list[int]) -> None:
    findings = find_stragglers(ranks, threshold=0.2, window_buckets=5)
    assert [f.rank for f in findings] == flagged, name


def test_straggler_reason_names_rank_and_margin() -> None:
    ranks = [_compute(0, [1.0] * 3), _compute(5, [1.31] * 3), _compute(2, [1.0] * 3)]
    (finding,) = find_stragglers(ranks, threshold=0.2, window_buckets=3)
    assert finding.reason == "slurmft: straggler rank 5 +31% over median"
