"""`slurmft report`: per-rank step times of a run, as numbers (steps.py) and a picture (plot.py,
the optional ``report`` extra)."""
