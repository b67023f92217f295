"""The `slurmft` command line. One module per command group; no business logic here."""

from __future__ import annotations

import sys

from slurmft.cli.app import app
from slurmft.errors import SlurmftError


def main(argv: list[str] | None = None) -> None:
    """Entry point: slurmft's own errors become one clear line on stderr, not a traceback."""
    try:
        app(args=argv, prog_name="slurmft")
    except SlurmftError as exc:
        print(f"slurmft: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


__all__ = ["app", "main"]
