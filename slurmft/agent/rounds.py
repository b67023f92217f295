"""torchrun's rendezvous rounds, told to the agent and to the workers (torchrun's process only).

Every time torchrun (re)starts its workers it first completes a new round of the c10d
rendezvous, and the round number is shared by all nodes. So a round names one restart exactly,
where the agents' other evidence does not: `TORCHELASTIC_RESTART_COUNT` counts only the
restarts of the node's own failed workers (membership-change restarts are not counted), and a
crashing script's survivors are often stopped before they can report their collective error.

`observe` wraps `DynamicRendezvousHandler.next_rendezvous`: after each round this torchrun
joins, it
- sends the agent a `round` message (`round`, and `previous`: the round it left, None for its
  first) over the ranks' report channel;
- sets `SLURMFT_RDZV_ROUND` in its own environment, which the workers it starts next inherit,
  so their reports (a collective error) name the round they ran in.

It only reads the state torch keeps (`_state_holder.state.round`); whatever it cannot read, it
leaves alone and torch runs unchanged: the agent then falls back to grouping reports by time
(slurmft.core.budget).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from slurmft.train.report import RDZV_ROUND_ENV, ReportChannel

ROUND_MESSAGE = "round"
_OBSERVED_MARK = "_slurmft_rounds_observed"


def current_round(handler: Any) -> int | None:
    """The round the handler's node has just joined, or None when torch keeps it elsewhere."""
    try:
        value = handler._state_holder.state.round
    except AttributeError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def observe(
    module: ModuleType,
    channel: ReportChannel | None = None,
    warn: Callable[[str], None] = lambda _: None,
) -> bool:
    """Patch the module's handler to report each round joined; False when it has none.
    ``warn`` is told once if a round cannot be read after all."""
    handler_cls = getattr(module, "DynamicRendezvousHandler", None)
    original = getattr(handler_cls, "next_rendezvous", None)
    if handler_cls is None or original is None:
        return False
    if getattr(handler_cls, _OBSERVED_MARK, False):
        return True
    reports = channel if channel is not None else ReportChannel()
    previous: int | None = None  # the round this torchrun was last in
    warned = False

    @functools.wraps(original)
    def next_rendezvous(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal previous, warned
        info = original(self, *args, **kwargs)
        joined = current_round(self)
        if joined is None:
            os.environ.pop(RDZV_ROUND_ENV, None)  # never a stale round on the next workers
            if not warned:
                warned = True
                warn("the rendezvous round is unreadable: restarts are grouped by time")
            return info
        os.environ[RDZV_ROUND_ENV] = str(joined)
        reports.send(ROUND_MESSAGE, round=joined, previous=previous)
        previous = joined
        return info

    handler_cls.next_rendezvous = next_rendezvous
    setattr(handler_cls, _OBSERVED_MARK, True)
    return True
