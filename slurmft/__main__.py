"""`python -m slurmft` is the `slurmft` command."""

from slurmft.cli import main

main()
