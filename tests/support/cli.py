"""The command line as a user runs it, in-process: the exit code, stdout and stderr."""

from __future__ import annotations

import pytest

from slurmft.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`slurmft ARGV...` through its entry point (errors become one line on stderr)."""
    try:
        main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    else:
        code = 0
    out, err = capsys.readouterr()
    return code, out, err
