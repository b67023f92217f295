"""Which peers of a rendezvous are dead (slurmft.agent.peer_watch): the policy alone."""

from __future__ import annotations

import pytest

from slurmft.agent.peer_watch import (
    LEFT,
    PeerWatch,
    WatchSettings,
    decode_dead,
    encode_dead,
    watched,
)

SETTINGS = WatchSettings(heartbeat_s=0.1, dead_after_s=1.5)


def polls(watch: PeerWatch, values: dict[str, str | None], start: float, count: int) -> float:
    """`count` polls 0.1 s apart seeing `values`; returns the time of the last."""
    now = start
    for _ in range(count):
        watch.observe(values, now)
        now += 0.1
    return now - 0.1


def test_a_peer_silent_for_the_limit_and_seen_so_by_enough_polls_is_dead() -> None:
    watch = PeerWatch(SETTINGS)
    now = polls(watch, {"b": "41"}, 0.0, 15)  # 1.4 s unchanged
    assert watch.verdicts(now) == []
    watch.observe({"b": "41"}, 1.5)
    (verdict,) = watch.verdicts(1.5)
    assert (verdict.peer, verdict.left, verdict.polls) == ("b", False, 15)
    assert "no rendezvous heartbeat for 1.5 s" in verdict.reason()


def test_a_peer_whose_counter_moves_is_alive_however_long_it_is_watched() -> None:
    watch = PeerWatch(SETTINGS)
    for n in range(100):
        watch.observe({"b": str(n // 5)}, n * 0.1)  # it writes every 0.5 s: slow, not dead
        assert watch.verdicts(n * 0.1) == []


def test_a_watcher_that_was_itself_frozen_declares_nobody_on_waking() -> None:
    """Its clock says 10 s of silence, but it polled twice: it did not watch the silence."""
    watch = PeerWatch(SETTINGS)
    watch.observe({"b": "7"}, 0.0)
    watch.observe({"b": "7"}, 10.0)  # frozen (or starved, or the store stalled) in between
    watch.observe({"b": "7"}, 10.1)
    assert watch.verdicts(10.1) == []
    polls(watch, {"b": "7"}, 10.2, SETTINGS.min_polls)
    assert [v.peer for v in watch.verdicts(11.0)] == ["b"]


def test_a_peer_that_left_is_told_apart_from_a_dead_one() -> None:
    watch = PeerWatch(SETTINGS)
    watch.observe({"b": "3"}, 0.0)
    watch.observe({"b": LEFT}, 0.1)
    (verdict,) = watch.verdicts(0.1)
    assert verdict.left
    assert verdict.reason() == "b left the rendezvous"


def test_a_peer_that_wrote_nothing_is_not_judged_and_one_unwatched_is_forgotten() -> None:
    watch = PeerWatch(SETTINGS)
    polls(watch, {"b": None, "c": "1"}, 0.0, 30)
    assert [v.peer for v in watch.verdicts(3.0)] == ["c"]
    watch.observe({"b": None}, 3.1)
    assert watch.verdicts(3.1) == []


@pytest.mark.parametrize(
    ("me", "members", "expected"),
    [
        ("b", ["a", "b", "c", "d"], ["c", "d"]),
        ("d", ["c", "a", "d", "b"], ["a", "b"]),  # a ring, sorted
        ("a", ["a", "b"], ["b"]),
        ("a", ["a"], []),
        ("s", ["a", "b", "c"], []),  # a spare watches nobody
    ],
)
def test_each_participant_watches_the_next_two_in_a_ring(
    me: str, members: list[str], expected: list[str]
) -> None:
    assert watched(me, members, 2) == expected


def test_every_member_of_a_ring_is_watched_by_two_others() -> None:
    members = [f"n{i:03d}" for i in range(50)]
    watchers: dict[str, int] = {}
    for me in members:
        for peer in watched(me, members, 2):
            watchers[peer] = watchers.get(peer, 0) + 1
    assert watchers == dict.fromkeys(members, 2)


def test_the_evicted_list_round_trips_and_garbage_reads_as_empty() -> None:
    assert decode_dead(encode_dead(["b", "a", "b"])) == ["a", "b"]
    assert decode_dead(b"") == []
    assert decode_dead(b"{not json") == []
    assert decode_dead(b'{"a": 1}') == []


def test_settings_refuse_a_heartbeat_no_faster_than_the_limit() -> None:
    with pytest.raises(ValueError, match="heartbeat_s < dead_after_s"):
        WatchSettings(heartbeat_s=2.0, dead_after_s=1.5)
    assert WatchSettings(0.1, 1.5).min_polls == 7
