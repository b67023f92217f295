"""`slurmft db`: schema migrations of the store."""

from __future__ import annotations

from typing import Annotated

import typer

from slurmft.cli.context import echo_json, state

app = typer.Typer(help="Create and upgrade the store's schema.", no_args_is_help=True)


@app.command("upgrade")
def upgrade(
    ctx: typer.Context,
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Bring the schema up to this slurmft's revision (creates the store if needed)."""
    database = state(ctx).database()
    before = database.current_revision()
    database.upgrade(revision)
    after = database.current_revision()
    typer.echo(f"{database.describe()}: {before or '(empty)'} -> {after}")


@app.command("downgrade")
def downgrade(
    ctx: typer.Context,
    revision: Annotated[str, typer.Argument(help="Target revision, e.g. -1 or base.")],
) -> None:
    """Step the schema back (for rolling back an upgrade of slurmft)."""
    database = state(ctx).database()
    before = database.current_revision()
    database.downgrade(revision)
    typer.echo(f"{database.describe()}: {before} -> {database.current_revision() or '(empty)'}")


@app.command("current")
def current(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Print the schema revision of the store and the one this slurmft needs."""
    database = state(ctx).database()
    status = database.schema_status()
    if as_json:
        echo_json(
            {
                "database": database.describe(),
                "current": status.current,
                "head": status.head,
                "at_head": status.at_head,
            }
        )
        return
    typer.echo(f"{database.describe()}: current {status.current or '(empty)'}, head {status.head}")


@app.command("check")
def check(ctx: typer.Context) -> None:
    """Exit 0 when the schema is at head; otherwise say what to run and exit 1."""
    database = state(ctx).database()
    database.require_current()
    typer.echo(f"{database.describe()}: schema is at head ({database.head_revision()})")
