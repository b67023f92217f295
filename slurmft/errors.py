"""The root of slurmft's own errors: the CLI prints their message (which says what to do next)
and exits non-zero instead of showing a traceback."""


class SlurmftError(Exception):
    """An error whose message is written for the person running slurmft."""

    exit_code = 1
