"""Fast dead-peer detection, eviction and fencing, in torchrun's process (launcher only).

Where the time of a recovery went before this: about 3.5 s of it waiting for the dead node's
torch keep-alive to expire (docs/agent.md). Here each launcher runs one thread that, every
`heartbeat_s`:
1. writes its own counter to `slurmft/peers/<run>/alive/<node>` in the rendezvous store;
2. reads the run's evicted list (`slurmft/peers/<run>/evicted`): finding itself there, it is
   fenced (below); the others on it are evicted from its view of the rendezvous;
3. reads the counters of the peers it watches (slurmft.agent.peer_watch: the next two
   participants in a ring) and declares those the policy finds dead: it adds them to the
   evicted list (compare-and-set) and tells its agent, which records the declaration.

Eviction: torch removes a node from the rendezvous when its last keep-alive is older than the
expiry, in `_BackendRendezvousStateHolder._sanitize`, which every sync runs on the state it
read; every node does it on its own copy, and the first one to write the state makes it stick.
The patch backdates the keep-alive of every evicted node before that check, so an evicted node
leaves the rendezvous exactly as an expired one does, seconds sooner; nothing else in torch's
protocol changes.

Fencing: a node on the evicted list that runs again (a frozen node that thaws) finds itself
there at its first poll. Its launcher then marks the node fenced (a file its workers check
before a checkpoint is committed), SIGKILLs everything below it (workers, zygote) and exits with
AgentExit.FENCED: it joins no collective of a round that moved on and writes nothing. Its agent
exits with the same code.

The gate (as rdzv_fix's): the names read and the fingerprint of `_sanitize`; on any difference
the launcher says so and torch's keep-alive alone detects dead nodes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from slurmft.agent import procs
from slurmft.agent.channel import PEER_DEAD_MESSAGE, STORE_BACK_MESSAGE, STORE_FAILED_MESSAGE
from slurmft.agent.peer_watch import (
    LEFT,
    PeerWatch,
    Verdict,
    WatchSettings,
    decode_dead,
    encode_dead,
    watched,
)
from slurmft.agent.rdzv_fix import check_fingerprints
from slurmft.core.exits import AgentExit
from slurmft.train.report import FENCE_FILE_ENV

KNOWN_FINGERPRINTS = {"_BackendRendezvousStateHolder._sanitize": "071461ebc46bd101"}
# Names read besides the fingerprinted function (whose check finds it missing, too).
REQUIRED_NAMES = ("DynamicRendezvousHandler.next_rendezvous",)
LONG_AGO = datetime(1970, 1, 1, tzinfo=UTC)

# Nodes (repr of torch's _NodeDesc) this process treats as expired: torchrun has one detector.
_evicted: set[str] = set()


def check_internals(module: ModuleType) -> list[str]:
    """What differs from the torch internals the patch was written and tested against."""
    missing = [f"{name} is missing" for name in REQUIRED_NAMES if not _has(module, name)]
    return missing + check_fingerprints(module, KNOWN_FINGERPRINTS)


def _has(module: ModuleType, dotted: str) -> bool:
    owner, _, name = dotted.partition(".")
    return hasattr(getattr(module, owner, None), name)


def _backdate_evicted(state: Any) -> None:
    heartbeats = state.last_heartbeats
    for node in list(heartbeats):
        if repr(node) in _evicted:
            heartbeats[node] = LONG_AGO


def _complete_round_members(state: Any) -> list[str] | None:
    """The participants of a complete round, None while the round is still forming."""
    if not state.complete:
        return None
    return [repr(node) for node in list(state.participants)]


class PeerDetector(threading.Thread):
    def __init__(
        self,
        store: Any,
        *,
        me: str,
        round_members: Callable[[], list[str] | None],
        run_id: str,
        settings: WatchSettings,
        tell: Callable[..., object],
        say: Callable[[str], None],
        fence: Callable[[], None],
    ):
        super().__init__(name="slurmft-peer-detector", daemon=True)
        self.store = store
        self.me = me
        self.round_members = round_members
        # The last complete round this node was in: what it watches, also while it rejoins
        # after a loss (torch then takes it out of the participants, yet the dead peer is
        # still in the way of the next round).
        self.members: list[str] = []
        self.prefix = f"slurmft/peers/{run_id}"
        self.settings = settings
        self.watch = PeerWatch(settings)
        self.tell = tell
        self.say = say
        self.fence = fence
        self.failing_since = 0.0
        self.stopped = threading.Event()

    def alive_key(self, node: str) -> str:
        return f"{self.prefix}/alive/{node}"

    @property
    def evicted_key(self) -> str:
        return f"{self.prefix}/evicted"

    def run(self) -> None:
        counter = 0
        while not self.stopped.is_set():
            started = time.monotonic()
            counter += 1
            try:
                self.poll(str(counter))
                if self.failing_since:
                    self.say("peer detector: the rendezvous store answers again")
                    self.tell(STORE_BACK_MESSAGE)
                self.failing_since = 0.0
            except Exception as error:  # a store error is torch's to act on; keep watching
                if not self.failing_since:
                    first_line = (str(error).splitlines() or [type(error).__name__])[0]
                    self.say(f"peer detector: the rendezvous store failed ({first_line})")
                    # Its agent dates torchrun's failure, if one follows, from here: a dead
                    # batch host takes the store along, and torchrun exits a second later.
                    self.tell(STORE_FAILED_MESSAGE, error=first_line)
                    self.failing_since = started
            self.stopped.wait(max(0.0, self.settings.heartbeat_s - (time.monotonic() - started)))

    def poll(self, counter: str) -> None:
        self.store.set(self.alive_key(self.me), counter)
        evicted = decode_dead(self.read_evicted())
        if self.me in evicted:
            self.fence()
            return
        _evicted.update(evicted)
        members = self.round_members()
        if members is not None and self.me in members:
            self.members = members
        alive = [m for m in self.members if m not in _evicted]
        peers = watched(self.me, alive, self.settings.successors)
        self.watch.observe(self.read_counters(peers), time.monotonic())
        for verdict in self.watch.verdicts(time.monotonic()):
            # A peer that left is no death, and is not evicted either: torch's keep-alive
            # removes it as before (evicted at once, the node that ends training first would
            # change the membership under the nodes still in their last step).
            if not verdict.left and verdict.peer not in _evicted:
                self.evict(verdict)

    def read_evicted(self) -> bytes:
        """The list as it is, or an empty one created: never a `get`, which waits for a missing
        key (a restarted store has none) while this node's heartbeat stops."""
        return bytes(self.store.compare_set(self.evicted_key, "", encode_dead([]).decode()))

    def read_counters(self, peers: list[str]) -> dict[str, str | None]:
        """Each peer's counter; None for one that has written none (a compare-and-set that
        finds no key leaves it empty: never a `get`, which would wait for it)."""
        found: dict[str, str | None] = {}
        for peer in peers:
            value = bytes(self.store.compare_set(self.alive_key(peer), "", "")).decode()
            found[peer] = value or None
        return found

    def evict(self, verdict: Verdict) -> None:
        while True:
            raw = self.read_evicted()
            nodes = decode_dead(raw)
            if verdict.peer in nodes:
                break
            desired = encode_dead([*nodes, verdict.peer])
            written = self.store.compare_set(self.evicted_key, raw.decode(), desired.decode())
            if bytes(written) == desired:
                break
        _evicted.add(verdict.peer)
        self.say(f"declared dead and evicted: {verdict.reason()}")
        self.tell(
            PEER_DEAD_MESSAGE,
            peer=verdict.peer,
            silent_s=round(verdict.silent_s, 3),
            reason=verdict.reason(),
        )

    def leave(self) -> None:
        """This launcher ends: its watchers read `left` and declare nothing."""
        self.stopped.set()
        # A poll still in flight could write a counter after `left`: its watchers would then
        # see the counter stop and declare this node dead.
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2 * self.settings.heartbeat_s + 1.0)
        with contextlib.suppress(Exception):
            self.store.set(self.alive_key(self.me), LEFT)


def fence_this_node(fence_file: str, say: Callable[[str], None]) -> None:
    """Declared dead by the others: nothing below this process may train or write again."""
    if fence_file:
        with contextlib.suppress(OSError):
            Path(fence_file).write_text("declared dead by its peers\n")
    say("this node was declared dead by its peers: stopping its workers and leaving")
    procs.signal_pids(procs.descendants(os.getpid()), signal.SIGKILL)
    sys.stderr.flush()
    os._exit(int(AgentExit.FENCED))


def apply(
    module: ModuleType,
    settings: WatchSettings,
    tell: Callable[..., object],
    say: Callable[[str], None],
) -> Callable[[], None]:
    """Patch the module (call only when check_internals is empty). Returns what the launcher
    calls when it ends (its watchers evict it at once)."""
    holder_cls = module._BackendRendezvousStateHolder
    handler_cls = module.DynamicRendezvousHandler
    original_sanitize = holder_cls._sanitize
    original_next_rendezvous = handler_cls.next_rendezvous
    detectors: list[PeerDetector] = []
    fence_file = os.environ.get(FENCE_FILE_ENV, "")

    @functools.wraps(original_sanitize)
    def sanitize(self: Any) -> None:
        if _evicted:
            _backdate_evicted(self._state)
        original_sanitize(self)

    @functools.wraps(original_next_rendezvous)
    def next_rendezvous(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not detectors:
            holder = self._state_holder
            detector = PeerDetector(
                self._store,
                me=repr(self._this_node),
                round_members=lambda: _complete_round_members(holder.state),
                run_id=self._settings.run_id,
                settings=settings,
                tell=tell,
                say=say,
                fence=lambda: fence_this_node(fence_file, say),
            )
            detectors.append(detector)
            detector.start()
        return original_next_rendezvous(self, *args, **kwargs)

    holder_cls._sanitize = sanitize
    handler_cls.next_rendezvous = next_rendezvous

    def leave() -> None:
        for detector in detectors:
            detector.leave()

    return leave
