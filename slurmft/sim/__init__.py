"""slurmft simulate and plan: a discrete-event simulator of long runs at scale that drives the
real policy (slurmft.controller.decide), and the planner built on it (docs/simulate.md)."""
