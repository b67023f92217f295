"""The agent's exit codes live in :mod:`slurmft.core.exits`; this name stays for its callers."""

from slurmft.core.exits import AgentExit

__all__ = ["AgentExit"]
