"""`slurmft report`: per-rank step times of a run, as numbers (steps.py) and a picture (plot.py,
the optional ``report`` extra)."""

# The widest picture, in step columns (steps are binned beyond it); the CLI's default too.
DEFAULT_MAX_COLUMNS = 400
