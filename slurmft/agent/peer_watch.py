"""Which peers of a rendezvous are dead: pure policy, observations in, verdicts out.

torch notices a dead node when its keep-alive expires: 1 s x 4 here, whole seconds by torch's
settings, and shorter removes live nodes (its keep-alive is a compare-and-set of the whole
rendezvous state). slurmft's detector (slurmft.agent.peer_detector, in torchrun's process) has
every node write a counter to its own key of the rendezvous store every `heartbeat_s`, and each
participant read the counters of the next `successors` participants after it in a ring (so the
store sees O(nodes) requests, not O(nodes^2)). A peer whose counter has not changed is judged on
the watcher's own clock and by the watcher's own completed polls:

- silent for `dead_after_s` (1.5 s: a 1 s SIGSTOP is not declared, 3 s is) by this node's
  monotonic clock, AND
- seen unchanged by at least `min_polls` of this node's polls since it last changed.

The second condition is what keeps a slow watcher or a slow store from declaring others: a
watcher that was itself frozen, starved of CPU, or blocked on a store that stalled, has made few
polls meanwhile, so it declares nobody until it has watched the silence itself. A peer whose
launcher is merely slow (a CPU hog beside it, its workers writing a checkpoint or in a GC pause:
they are other processes) still writes its counter several times a second.

A peer that wrote LEFT (its launcher ended: training done, or stopped) is no death: the
detector leaves it to torch's keep-alive (evicted at once, it would change the membership under
nodes still in their last step, and torch restarts workers on that).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

LEFT = "left"


@dataclass(frozen=True)
class WatchSettings:
    heartbeat_s: float = 0.1
    dead_after_s: float = 1.5
    successors: int = 2  # how many peers each participant watches

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError("need 0 < heartbeat_s < dead_after_s")
        if self.successors < 1:
            raise ValueError("each participant must watch at least one peer")

    @property
    def min_polls(self) -> int:
        """Half the polls a watcher makes in `dead_after_s`: it must have watched the silence."""
        return max(2, int(self.dead_after_s / self.heartbeat_s / 2))


@dataclass(frozen=True)
class Verdict:
    peer: str
    left: bool  # it said it left; else it is dead
    silent_s: float
    polls: int

    def reason(self) -> str:
        if self.left:
            return f"{self.peer} left the rendezvous"
        return (
            f"{self.peer}: no rendezvous heartbeat for {self.silent_s:.1f} s "
            f"({self.polls} polls of its counter unchanged)"
        )


@dataclass
class _Clock:
    value: str
    changed_at: float
    polls: int = 0


@dataclass
class PeerWatch:
    settings: WatchSettings
    _clocks: dict[str, _Clock] = field(default_factory=dict)

    def observe(self, seen: Mapping[str, str | None], now: float) -> None:
        """One completed poll: each watched peer's counter, None while it has written none
        (a peer never seen alive is left to torch's keep-alive)."""
        for peer in [p for p in self._clocks if p not in seen]:
            del self._clocks[peer]  # no longer watched
        for peer, value in seen.items():
            if value is None:
                continue
            clock = self._clocks.get(peer)
            if clock is None or clock.value != value:
                self._clocks[peer] = _Clock(value, now)
            else:
                clock.polls += 1

    def verdicts(self, now: float) -> list[Verdict]:
        found = []
        for peer, clock in self._clocks.items():
            silent_s = now - clock.changed_at
            if clock.value == LEFT:
                found.append(Verdict(peer, True, silent_s, clock.polls))
            elif silent_s >= self.settings.dead_after_s and clock.polls >= self.settings.min_polls:
                found.append(Verdict(peer, False, silent_s, clock.polls))
        return found


def watched(me: str, participants: Iterable[str], successors: int) -> list[str]:
    """The peers `me` watches: the next `successors` participants after it in their sorted
    ring. A node that is no participant (a spare) watches nobody."""
    ring = sorted(set(participants))
    if me not in ring:
        return []
    start = ring.index(me)
    others = ring[start + 1 :] + ring[:start]
    return others[:successors]


def decode_dead(raw: bytes) -> list[str]:
    """The store's list of declared-dead nodes; anything unreadable is an empty list (the
    detector then only misses a declaration, which torch's keep-alive still makes)."""
    try:
        value = json.loads(raw or b"[]")
    except ValueError:
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def encode_dead(nodes: Iterable[str]) -> bytes:
    return json.dumps(sorted(set(nodes))).encode()
