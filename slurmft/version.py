"""slurmft's version, read from its installed metadata on first use."""

from __future__ import annotations

from functools import cache


@cache
def version() -> str:
    # Read on first use: importing importlib.metadata costs ~0.1 s, paid by every training
    # worker that imports slurmft.train, on the recovery path after a node loss.
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("slurmft")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"
