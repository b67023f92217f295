"""slurmft's view of Slurm: the SlurmClient protocol (api.py) and its CLI backend."""

from typing import TYPE_CHECKING

from slurmft._lazy import lazy_exports

if TYPE_CHECKING:
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

_EXPORTS = {
    "JobInfo": "api",
    "NodeInfo": "api",
    "SignalTarget": "api",
    "SlurmBadRequest": "api",
    "SlurmClient": "api",
    "SlurmError": "api",
    "SlurmJobNotFound": "api",
    "SlurmPermissionDenied": "api",
    "SlurmTimeout": "api",
    "SlurmUnreachable": "api",
    "SubmitRequest": "api",
    "CliSlurmClient": "cli_backend",
    "JobPhase": "states",
    "JobState": "states",
    "NodeBase": "states",
    "NodeFlag": "states",
    "NodeStatus": "states",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
