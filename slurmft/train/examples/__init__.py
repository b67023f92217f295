"""Example training scripts that use slurmft.train (run with torchrun -m)."""
