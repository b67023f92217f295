"""The fix for torch's wait-list restart loop, behind a version gate.

Defect (torch 2.13, measured in docs/measured/torchrun.md): when more agents are alive than
`max_nodes` (two spares, or a worker crash whose agent survives while a spare exists), agents
leaving round N rejoin through the *wait list* while round N is still complete. When the next
round fills, the leftover agent stays in `wait_list` for good, `num_nodes_waiting() > 0`, and
every healthy agent restarts its workers again, forever: membership-change restarts do not
count against `--max-restarts`. Fix:
  (a) `num_nodes_waiting()` reports 0 while the current round is complete and full: nobody can
      join it, so there is nothing to restart for;
  (b) a node in the wait list that finds the round complete and full moves itself to the
      redundancy list, where spares wait without a timeout and without counting as waiting.

Shorter state poll: an agent waiting for the rendezvous to change (the survivors after a node
loss, a spare waiting for a free rank) syncs the state, then sleeps one second, hard-coded
(`_delay(seconds=1)` in `_DistributedRendezvousOpExecutor.run`); and a sync with nothing to write
serves a cached state for one second (`_BackendRendezvousStateHolder`'s `cache_duration`, 1 in
`from_backend`). A recovery waits for several such polls in a row (the dead node's expiry, the
spare's join, the others seeing the round complete). `apply` can shorten both to the same poll,
the cache only while the agent is inside `next_rendezvous` (a trained round keeps torch's one
second: its monitor loop reads the state ten times a second); the rendezvous logic, the
keep-alive heartbeats and their expiry are unchanged.

The gate: the fix wraps four torch internals and assumes the names it reads. `check_internals`
verifies the names and a fingerprint of each wrapped function's source; on any difference the
launcher says so and the job runs without spares instead of with a fix that may misbehave.

torch is imported only inside `load_module`, by the launcher in torchrun's own process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from types import ModuleType
from typing import Any

DYNAMIC_RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_APPLIED_MARK = "_slurmft_wait_list_fix"
_POLL_MARK = "_slurmft_poll_s"
# torch's state poll, the one sleep that `apply` shortens: `run` sleeps it on every _Action.SYNC.
TORCH_POLL_S = 1.0

# sha256 (first 16 hex) of each function's source, whitespace-normalized, as in torch 2.13.0.
KNOWN_FINGERPRINTS: dict[str, str] = {
    "DynamicRendezvousHandler.num_nodes_waiting": "991cd73061cb4b7f",
    "_RendezvousJoinOp.__call__": "d2701b435c9b3b89",
    "_DistributedRendezvousOpExecutor.run": "1ca9b15cdee22a77",
    "_DistributedRendezvousOpExecutor._add_to_redundancy_list": "5f07e1a5257e7315",
    "_delay": "6cd5700116d2d715",
    "_BackendRendezvousStateHolder.__init__": "438d834558716598",
    "_BackendRendezvousStateHolder.sync": "b2a092020f5ec77a",
}
# Every `_delay(...)` call in the module, as in torch 2.13.0: the poll (in `run`, checked by its
# fingerprint above) and the first round's random skew. A new one-second call elsewhere would be
# shortened too, so any change here refuses the fix.
KNOWN_DELAY_CALLS = ("_delay(seconds=1)", "_delay(seconds=(0, 0.3))")
# Names the fix reads besides the wrapped functions.
REQUIRED_NAMES = (
    "_Action.ADD_TO_REDUNDANCY_LIST",
    "DynamicRendezvousHandler.next_rendezvous",
    "DynamicRendezvousHandler.settings",
    "_RendezvousState",
)
REQUIRED_STATE_FIELDS = ("complete", "closed", "participants", "wait_list", "redundancy_list")


def load_module() -> ModuleType:
    return importlib.import_module(DYNAMIC_RENDEZVOUS)


def _lookup(module: ModuleType, dotted: str) -> Any:
    obj: Any = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def fingerprint(function: Any) -> str:
    source = inspect.getsource(function)
    normalized = "\n".join(line.strip() for line in source.splitlines() if line.strip())
    return hashlib.sha256(normalized.encode()).hexdigest()[:16]


def check_internals(module: ModuleType) -> list[str]:
    """What differs from the torch internals the fix was written and tested against."""
    problems: list[str] = []
    for name in REQUIRED_NAMES:
        try:
            _lookup(module, name)
        except AttributeError:
            problems.append(f"{name} is missing")
    state_cls = getattr(module, "_RendezvousState", None)
    if state_cls is not None:
        try:
            state = state_cls()
            problems += [
                f"_RendezvousState.{f} is missing"
                for f in REQUIRED_STATE_FIELDS
                if not hasattr(state, f)
            ]
        except Exception as error:  # a changed constructor is a changed internal
            problems.append(f"_RendezvousState() failed: {error}")
    return (
        problems
        + check_fingerprints(module, KNOWN_FINGERPRINTS)
        + check_delay_calls(_module_source(module))
    )


def check_fingerprints(module: ModuleType, known: dict[str, str]) -> list[str]:
    """What differs from each function's known source fingerprint (dotted name -> hash)."""
    problems: list[str] = []
    for name, expected in known.items():
        try:
            seen = fingerprint(_lookup(module, name))
        except AttributeError:
            problems.append(f"{name} is missing")
            continue
        except (OSError, TypeError) as error:
            problems.append(f"{name}: source unavailable ({error})")
            continue
        if seen != expected:
            problems.append(f"{name} changed (source fingerprint {seen}, expected {expected})")
    return problems


def _module_source(module: ModuleType) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


def check_delay_calls(source: str) -> list[str]:
    """The module's `_delay(...)` calls must be the known ones: `apply` shortens one of them."""
    calls = tuple(line.strip() for line in source.splitlines() if "_delay(" in line)
    if calls == KNOWN_DELAY_CALLS:
        return []
    return [f"_delay calls changed ({'; '.join(calls) or 'none found'})"]


def is_applied(module: ModuleType) -> bool:
    return bool(getattr(module, _APPLIED_MARK, False))


def _round_full(state: Any, max_nodes: int) -> bool:
    return bool(state.complete) and len(state.participants) >= max_nodes


def poll_interval(module: ModuleType) -> float:
    """The state poll the module now sleeps (torch's own until `apply` shortened it)."""
    return float(getattr(module, _POLL_MARK, TORCH_POLL_S))


def _shorten_poll(module: ModuleType, poll_s: float) -> None:
    original_delay = module._delay

    @functools.wraps(original_delay)
    def delay(seconds: float | tuple[float, float]) -> None:
        # Only the poll sleeps exactly one second (check_delay_calls); the skew is a tuple.
        original_delay(poll_s if seconds == TORCH_POLL_S else seconds)

    handler_cls = module.DynamicRendezvousHandler
    original_next_rendezvous = handler_cls.next_rendezvous

    @functools.wraps(original_next_rendezvous)
    def next_rendezvous(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A cached state older than one poll would make the shorter poll read nothing new; but
        # only a rendezvous in progress needs it. While the workers train, the monitor loop asks
        # num_nodes_waiting() every 0.1 s (torchrun's --monitor-interval): with a short cache
        # each ask is a store round trip, ten a second per agent on the agent and the store,
        # for nothing a recovery waits on (a lost peer fails the workers, which ends training).
        holder = self._state_holder
        training_cache_s = holder._cache_duration
        holder._cache_duration = min(training_cache_s, poll_s)
        try:
            return original_next_rendezvous(self, *args, **kwargs)
        finally:
            holder._cache_duration = training_cache_s

    vars(module)["_delay"] = delay  # a module's attributes are its __dict__
    handler_cls.next_rendezvous = next_rendezvous
    setattr(module, _POLL_MARK, poll_s)


def apply(module: ModuleType, poll_s: float = TORCH_POLL_S) -> None:
    """Patch the module's classes in place (idempotent); with `poll_s` below torch's 1 s, also
    shorten the state poll. Call only when check_internals is empty."""
    if not 0 < poll_s <= TORCH_POLL_S:
        raise ValueError(f"poll_s must be in (0, {TORCH_POLL_S}], not {poll_s}")
    if is_applied(module):
        return
    if poll_s < TORCH_POLL_S:
        _shorten_poll(module, poll_s)
    handler_cls = module.DynamicRendezvousHandler
    join_op_cls = module._RendezvousJoinOp
    executor_cls = module._DistributedRendezvousOpExecutor
    add_to_redundancy_list = module._Action.ADD_TO_REDUNDANCY_LIST
    original_num_nodes_waiting = handler_cls.num_nodes_waiting
    original_join = join_op_cls.__call__
    original_add_redundant = executor_cls._add_to_redundancy_list

    def num_nodes_waiting(self: Any) -> int:
        waiting: int = original_num_nodes_waiting(self)  # syncs the state first
        if _round_full(self._state_holder.state, self.settings.max_nodes):
            return 0  # (a)
        return waiting

    def join(self: Any, ctx: Any, deadline: float) -> Any:
        state = ctx.state
        if (
            not state.closed
            and ctx.node in state.wait_list
            and ctx.node not in state.participants
            and _round_full(state, ctx.settings.max_nodes)
        ):
            return add_to_redundancy_list  # (b)
        return original_join(self, ctx, deadline)

    def add_redundant(self: Any) -> None:
        # torch adds to the redundancy list only nodes that are not waiting; (b) moves one.
        self._state.wait_list.discard(self._node)
        original_add_redundant(self)

    handler_cls.num_nodes_waiting = num_nodes_waiting
    join_op_cls.__call__ = join
    executor_cls._add_to_redundancy_list = add_redundant
    setattr(module, _APPLIED_MARK, True)
