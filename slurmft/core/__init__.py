"""The words every part of slurmft shares, and nothing else: read this package first.

Standard library only. The store maps these types to columns, the wire protocol carries their
values, the agent, the batch step and the daemon's policy decide with them; none of those may
be imported from here, so the node side never pays for the daemon's or the store's imports.

- `kinds`: node roles, fault classes, event kinds, action kinds and statuses (stored values).
- `states`: the run and attempt state machines, with their legal transitions, and the phase
  of a Slurm job (waiting, active, ended) that both the Slurm client and the policy use.
- `exits`: the exit codes the agent and the batch step end with, what each means, and the
  outcome each agent of a step writes for the batch step.
- `budget`: the restart budget and the one rule of progress that resets it.
- `defaults`: the restart cap's default, shared with its setting.
- `torch_support`: which torch versions each of slurmft's torch patches was tested with.

Package modules are imported by name (``from slurmft.core.kinds import FaultClass``): this file
imports nothing.
"""
