"""Which torch versions each of slurmft's torch patches knows: the one registry that `submit`,
the launcher and the docs read.

slurmft changes torch's behaviour in torchrun's own process in a few places, each written and
tested against one torch's internals. Each checks at run time that it still sees what it was
written for and otherwise leaves torch alone; this registry says which versions that check was
made on, so a user hears before the job starts (`slurmft submit`), not from a log, when the torch
they run is one slurmft was not tested with. A version listed here is no promise the check
passes (a patched build may differ); one not listed may still pass it.

Standard library only: `submit` reads the installed torch's version from its package metadata,
never by importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class TorchPatch:
    name: str
    module: str  # where it lives
    purpose: str
    known: tuple[str, ...]  # torch release series ("2.13") whose internals it was tested against
    checked_by: str  # what it verifies at run time before it changes anything
    without_it: str  # what the run loses when the check refuses the patch


WAIT_LIST_FIX = "wait-list fix"

PATCHES: tuple[TorchPatch, ...] = (
    TorchPatch(
        name=WAIT_LIST_FIX,
        module="slurmft.agent.rdzv_fix",
        purpose="hot spares without torch's endless wait-list restarts",
        known=("2.13",),
        checked_by="names and source fingerprints of the rendezvous functions it wraps",
        without_it="the job runs without hot spares (spare agents refuse to join)",
    ),
    TorchPatch(
        name="rendezvous state poll",
        module="slurmft.agent.rdzv_fix",
        purpose="a 0.1 s rendezvous poll while an agent waits for a round (torch: 1 s)",
        known=("2.13",),
        checked_by="the same gate as the wait-list fix, and every `_delay` call in the module",
        without_it="recoveries wait torch's 1 s polls (seconds slower)",
    ),
    TorchPatch(
        name="rendezvous rounds",
        module="slurmft.agent.rounds",
        purpose="each restart named by its rendezvous round, so the budget counts it once",
        known=("2.13",),
        checked_by="reads the handler's round; anything it cannot read it leaves alone",
        without_it="restarts are grouped by the time of their reports (may merge two)",
    ),
    TorchPatch(
        name="dead-peer eviction",
        module="slurmft.agent.peer_detector",
        purpose="a node declared dead by slurmft's detector (1.5 s) leaves the rendezvous as an "
        "expired one does, without waiting for torch's keep-alive expiry (4 s)",
        known=("2.13",),
        checked_by="the names it reads and the source fingerprint of the state holder's "
        "_sanitize",
        without_it="dead nodes leave when torch's keep-alive expires (seconds later); no "
        "fencing of a node that thaws",
    ),
    TorchPatch(
        name="warm workers",
        module="slurmft.agent.zygote",
        purpose="new workers forked from a zygote that imported torch and the script's imports",
        known=("2.13",),
        checked_by="the zygote refuses to fork once an import initialised CUDA or a loaded "
        "source changed; a worker without a fork starts cold",
        without_it="workers start cold: each imports torch and the script's imports (2-3 s)",
    ),
    TorchPatch(
        name="graceful spare exit",
        module="slurmft.agent.launcher",
        purpose="a spare still waiting when training ends exits 0, not 1",
        known=("2.13",),
        checked_by="nothing to check: it changes only a None result of SimpleElasticAgent.run",
        without_it="always applied; a torch whose run never returns None is unchanged by it",
    ),
)


# Patches that matter only to a run with spares.
SPARES_ONLY = frozenset({WAIT_LIST_FIX})


def patch(name: str) -> TorchPatch:
    """The registry's entry of that name (KeyError for a name it does not have)."""
    for entry in PATCHES:
        if entry.name == name:
            return entry
    raise KeyError(name)


def release_series(version: str) -> str:
    """ "2.13.0+cpu" -> "2.13"."""
    return ".".join(version.split("+", 1)[0].split(".")[:2])


def unknown_to(version: str) -> tuple[TorchPatch, ...]:
    """The patches whose tested versions do not include this torch's release series."""
    series = release_series(version)
    return tuple(patch for patch in PATCHES if series not in patch.known)


def known_series() -> tuple[str, ...]:
    """Every release series some patch was tested against, oldest first."""
    found = {series for patch in PATCHES for series in patch.known}
    return tuple(sorted(found, key=lambda s: tuple(int(p) for p in s.split("."))))


def installed_version() -> str | None:
    """This environment's torch version, from its package metadata (no import); None when torch
    is not installed here."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def spares_work_with(version: str | None) -> bool:
    """Whether hot spares can work with this torch: the wait-list fix knows its release series.
    True when torch is not installed where `submit` runs (the agents check on the nodes)."""
    return version is None or release_series(version) in patch(WAIT_LIST_FIX).known


def warnings_for(version: str | None, spares: int) -> list[str]:
    """What `slurmft submit` tells a user about the torch their run will use: nothing for a
    version every patch was tested with, or when torch is not installed where submit runs (the
    agents check on the nodes); else one line per patch that matters to this run."""
    if version is None:
        return []
    unknown = [p for p in unknown_to(version) if spares > 0 or p.name not in SPARES_ONLY]
    if not unknown:
        return []
    tested = ", ".join(known_series())
    return [
        f"warning: torch {version} is not a version slurmft's torch patches were tested with "
        f"({tested}); each checks torch when the job starts and, if it refuses, leaves torch "
        f"alone:",
        *(f"  {p.name} ({p.module}): {p.without_it}" for p in unknown),
    ]


def reference_markdown() -> str:
    """The docs' table of the patches (docs/agent.md), generated from this registry."""
    rows = [
        "| patch | where | what for | tested with torch | checked at start by | refused: |",
        "|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {p.name} | `{p.module}` | {p.purpose} | {', '.join(p.known)} | {p.checked_by} "
        f"| {p.without_it} |"
        for p in PATCHES
    ]
    return "\n".join(rows) + "\n"
