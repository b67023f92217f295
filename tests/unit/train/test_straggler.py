from __future__ import annotations

import random

from slurmft.train.straggler import PeerGroups, StragglerDetector


def noisy(base: float, rng: random.Random) -> float:
    return base * rng.uniform(0.9, 1.1)


def test_a_rank_30_percent_slower_is_named_once_the_window_is_full() -> None:
    rng = random.Random(0)
    detector = StragglerDetector(PeerGroups.uniform(4), window=10)
    found = []
    for step in range(12):
        times = [noisy(0.2, rng) for _ in range(4)]
        times[1] = noisy(0.26, rng)
        found = detector.observe(times)
        if step < 9:
            assert found == []
    assert [s.rank for s in found] == [1]
    assert 1.2 < found[0].ratio < 1.45


def test_single_slow_steps_and_noise_name_nobody() -> None:
    rng = random.Random(1)
    detector = StragglerDetector(PeerGroups.uniform(3), window=10)
    for step in range(100):
        times = [noisy(0.2, rng) for _ in range(3)]
        if step % 7 == 0:
            times[step % 3] = 0.6  # one slow step (GC, a page fault) now and then
        assert detector.observe(times) == []


def test_ranks_are_compared_within_their_peer_group_only() -> None:
    # Two pipeline stages: stage b is slower by design, and rank 4 is slow within it.
    groups = PeerGroups(["a", "a", "b", "b", "b"])
    detector = StragglerDetector(groups, window=5)
    found = []
    for _ in range(5):
        found = detector.observe([0.1, 0.1, 0.3, 0.3, 0.4])
    assert [(s.rank, s.group) for s in found] == [(4, "b")]


def test_a_rank_alone_in_its_group_is_never_named() -> None:
    detector = StragglerDetector(PeerGroups(["a", "a", "solo"]), window=3)
    for _ in range(5):
        assert detector.observe([0.1, 0.1, 5.0]) == []
