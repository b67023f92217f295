"""slurmft: fault tolerance for long distributed training runs on Slurm."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("slurmft")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
