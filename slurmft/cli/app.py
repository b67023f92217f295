"""The typer application and the options every command shares."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slurmft.cli import (
    agent_cmd,
    config_cmd,
    daemon_cmd,
    db_cmd,
    gpu_cmd,
    history_cmd,
    logs_cmd,
    nodes_cmd,
    report_cmd,
    runs_cmd,
    sim_cmd,
    submit_cmd,
)
from slurmft.cli.context import CliState
from slurmft.version import version as slurmft_version

app = typer.Typer(
    name="slurmft",
    help="Keep long distributed training runs on Slurm alive through GPU faults, dead or hung "
    "nodes and stragglers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(agent_cmd.app, name="agent")
app.add_typer(config_cmd.app, name="config")
app.add_typer(db_cmd.app, name="db")
app.add_typer(history_cmd.app, name="history")
app.add_typer(gpu_cmd.app, name="gpu")
app.add_typer(nodes_cmd.app, name="nodes")
runs_cmd.register(app)
daemon_cmd.register(app)
submit_cmd.register(app)
report_cmd.register(app)
logs_cmd.register(app)
sim_cmd.register(app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"slurmft {slurmft_version()}")  # read on use: importlib.metadata
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Config file (TOML); default: $SLURMFT_CONFIG. "
            "Read after /etc/slurmft/slurmft.toml.",
            show_default=False,
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override one setting: section.key=value (repeatable; wins "
            "over files and environment).",
            show_default=False,
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print version.")
    ] = False,
) -> None:
    ctx.obj = CliState(config_file=config, overrides=list(set_ or []))
