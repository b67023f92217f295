"""The run and attempt state machines live in :mod:`slurmft.core.states`; this name stays for
the code and the migrations that import it from here."""

from slurmft.core.states import (
    ATTEMPT_TRANSITIONS,
    RUN_TRANSITIONS,
    AttemptState,
    IllegalTransition,
    RunState,
    check_transition,
)

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "RUN_TRANSITIONS",
    "AttemptState",
    "IllegalTransition",
    "RunState",
    "check_transition",
]
