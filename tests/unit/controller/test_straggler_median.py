"""The straggler detector's median of the other ranks, read off one sorted list per bucket, is
exactly the median of the others that `statistics.median` gives (the findings cannot change)."""

from __future__ import annotations

import statistics

from hypothesis import given
from hypothesis import strategies as st

from slurmft.controller.detect import RankCompute, _median_without, find_stragglers

# Few distinct values: ties between ranks are the case to get right.
COMPUTE = st.sampled_from([0.5, 1.0, 1.0, 1.2, 1.3, 2.0, 0.0])


@given(st.lists(COMPUTE, min_size=2, max_size=12))
def test_median_without_one_rank_is_the_median_of_the_others(values: list[float]) -> None:
    ordered = sorted(values)
    for index, value in enumerate(values):
        others = values[:index] + values[index + 1 :]
        assert _median_without(ordered, value) == statistics.median(others)


@given(st.lists(st.lists(COMPUTE, min_size=3, max_size=3), min_size=2, max_size=9))
def test_findings_are_those_of_the_plain_definition(buckets: list[list[float]]) -> None:
    ranks = [RankCompute(rank, f"n{rank}", tuple(b)) for rank, b in enumerate(buckets)]
    expected = []
    for member in ranks:
        others = [m for m in ranks if m is not member]
        ratios = []
        for i in range(-3, 0):
            median = statistics.median(m.buckets[i] for m in others)
            ratios.append(member.buckets[i] / median - 1.0 if median > 0 else 0.0)
        if all(r > 0.2 for r in ratios):
            expected.append((member.rank, statistics.fmean(ratios)))
    found = find_stragglers(ranks, threshold=0.2, window_buckets=3)
    assert [(f.rank, f.margin) for f in found] == expected
