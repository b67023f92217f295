"""slurmft: fault tolerance for long distributed training runs on Slurm."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurmft.api import Run, RunSpec, plan_submission, runs, submit

# The Python API (slurmft.api), loaded on first use: `import slurmft.train` in every training
# worker never loads the daemon's socket client.
_API = frozenset({"Run", "RunSpec", "plan_submission", "runs", "submit"})
__all__ = ["Run", "RunSpec", "__version__", "plan_submission", "runs", "submit"]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from slurmft.version import version

        return version()
    if name in _API:
        import slurmft.api

        return getattr(slurmft.api, name)
    raise AttributeError(f"module 'slurmft' has no attribute {name!r}")
