"""`slurmft history`: the failure-history views, as a table or JSON."""

from __future__ import annotations

from typing import Annotated

import typer

from slurmft.cli.context import echo_json, state
from slurmft.cli.runs_cmd import ask
from slurmft.db.history import HISTORY_VIEWS, read_view
from slurmft.errors import SlurmftError

# Admins, the daemon's user or a database role: read the store itself, not through the daemon.
STORE = Annotated[
    bool,
    typer.Option(
        "--store",
        help="Read the store directly (for whoever may: admins, the daemon's user, a database "
        "role) instead of asking the daemon.",
    ),
]

app = typer.Typer(
    help="Failure history from the store's SQL views: "
    + "; ".join(f"{v.name} ({v.question})" for v in HISTORY_VIEWS.values()),
    no_args_is_help=True,
)


@app.command("show")
def show(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    view: Annotated[str, typer.Argument(help="One of: " + ", ".join(HISTORY_VIEWS))],
    run: Annotated[str | None, typer.Option("--run", help="Only this run (run views).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most N rows.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    store: STORE = False,
) -> None:
    """Print one failure-history view. Asked of the daemon: a run view shows your own runs
    (an admin's, every run); the node and fault-class views are the same for everyone."""
    if view not in HISTORY_VIEWS:
        raise SlurmftError(f"unknown view {view!r}; choose one of: {', '.join(HISTORY_VIEWS)}")
    if store:
        database = state(ctx).database()
        database.require_current()
        with database.session() as session:
            rows = read_view(session, view, run_id=run, limit=limit)
    else:
        rows = ask(ctx, "history", view=view, run_id=run, limit=limit)["rows"]
    if as_json:
        echo_json(rows)
        return
    _print_table(rows)


@app.command("list")
def list_views() -> None:
    """List the views and the question each answers."""
    for v in HISTORY_VIEWS.values():
        typer.echo(f"{v.name:<20} {v.question}")


def _print_table(rows: list[dict[str, object]]) -> None:
    if not rows:
        typer.echo("(no rows)")
        return
    columns = list(rows[0])
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
