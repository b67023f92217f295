"""slurmft's view of Slurm: the SlurmClient protocol (api.py) and its CLI backend."""

from slurmft.slurm.api import (
    JobInfo,
    NodeInfo,
    SignalTarget,
    SlurmBadRequest,
    SlurmClient,
    SlurmError,
    SlurmJobNotFound,
    SlurmPermissionDenied,
    SlurmTimeout,
    SlurmUnreachable,
    SubmitRequest,
)
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.states import JobPhase, JobState, NodeBase, NodeFlag, NodeStatus

__all__ = [
    "CliSlurmClient",
    "JobInfo",
    "JobPhase",
    "JobState",
    "NodeBase",
    "NodeFlag",
    "NodeInfo",
    "NodeStatus",
    "SignalTarget",
    "SlurmBadRequest",
    "SlurmClient",
    "SlurmError",
    "SlurmJobNotFound",
    "SlurmPermissionDenied",
    "SlurmTimeout",
    "SlurmUnreachable",
    "SubmitRequest",
]
