"""`slurmft config`: what the effective configuration is and where each value came from."""

from __future__ import annotations

from typing import Annotated

import typer

from slurmft.cli.context import echo_json, state

app = typer.Typer(help="Inspect the effective configuration.", no_args_is_help=True)


@app.command("show")
def show(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Print every setting, its effective value and where it came from."""
    config = state(ctx).config
    resolved = {
        "state_dir": str(config.state_dir),
        "runtime_dir": str(config.runtime_dir),
        "database_url": _redacted_url(config.database_url),
    }
    if as_json:
        echo_json({"settings": config.as_dict(), "resolved": resolved})
        return
    width = max(len(key) for key, _ in config.items())
    for key, value in config.items():
        typer.echo(f"{key:<{width}}  {value.value!r:<32}  # {value.source}")
    typer.echo("")
    for key, text in resolved.items():
        typer.echo(f"{key:<{width}}  {text}")


def _redacted_url(url: str) -> str:
    from slurmft.db.database import normalize_url  # SQLAlchemy only for `config show`

    return normalize_url(url).render_as_string(hide_password=True)


@app.command("reference")
def reference() -> None:
    """Print the reference of every setting as Markdown (the source of docs/config.md)."""
    from slurmft.config import reference_markdown

    typer.echo(reference_markdown(), nl=False)
