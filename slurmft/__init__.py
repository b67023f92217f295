"""slurmft: fault tolerance for long distributed training runs on Slurm."""

from __future__ import annotations

from functools import cache


@cache
def _version() -> str:
    # Read on first use: importing importlib.metadata costs ~0.1 s, paid by every training
    # worker that imports slurmft.train, on the recovery path after a node loss.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slurmft")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'slurmft' has no attribute {name!r}")
