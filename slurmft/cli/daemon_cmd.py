"""`slurmft daemon`: run the controller in the foreground (systemd runs it as a service)."""

from __future__ import annotations

from typing import Annotated

import typer

from slurmft.cli.context import state


def daemon(
    ctx: typer.Context,
    log_format: Annotated[
        str | None, typer.Option("--log-format", help="text or json (default: log.format).")
    ] = None,
    observe_only: Annotated[
        bool, typer.Option("--observe-only", help="Decide and record, act on nothing.")
    ] = False,
) -> None:
    """Run the controller: watch Slurm and the agents, and recover runs, until SIGTERM."""
    from slurmft.controller.daemon import Daemon
    from slurmft.logs import setup_logging

    cli = state(ctx)
    if observe_only:
        cli.overrides.append("daemon.observe_only=true")
    if log_format is not None:
        cli.overrides.append(f"log.format={log_format}")
    config = cli.config
    setup_logging(config.settings.log.level, config.settings.log.format)
    Daemon(config).run_until_signalled()


def register(app: typer.Typer) -> None:
    app.command()(daemon)
