"""`slurmft report RUN`: the picture of a run (its timeline, its per-rank step times), or its
numbers with --json.

The daemon reads the store for the caller (their own runs; an admin's, every run) and sends the
numbers; the picture is drawn here. `--store` reads the store directly, for whoever may (the
daemon's user, an admin, a database role for the ML team).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slurmft.cli.context import echo_json, state
from slurmft.cli.history_cmd import STORE
from slurmft.cli.runs_cmd import ask
from slurmft.report import DEFAULT_MAX_COLUMNS


def report(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    run_id: Annotated[str, typer.Argument(help="Run id (see `slurmft runs`).")],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="PNG to write (default: <RUN>-steps.png here)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the numbers instead of drawing.")
    ] = False,
    max_columns: Annotated[
        int, typer.Option("--max-columns", min=10, help="Bin a long run into this many columns.")
    ] = DEFAULT_MAX_COLUMNS,
    store: STORE = False,
) -> None:
    """The run's picture: its wall-clock timeline (world size, step rate, failures with the time
    each cost shaded by cause, restarts, requeues, actions) above a ranks x steps heat map of
    own compute time over the median band, with stragglers, hangs, restarts and the
    controller's actions marked."""
    cli = state(ctx)
    from slurmft.report.steps import StepPicture, load_step_picture

    if store:
        database = cli.database()
        database.require_current()
        with database.session() as session:
            picture = load_step_picture(session, run_id, max_columns=max_columns)
        database.dispose()
    else:
        answer = ask(ctx, "report", run_id=run_id, max_columns=max_columns)
        picture = StepPicture.from_json(answer)
    if as_json:
        echo_json(picture.to_json())
        return
    from slurmft.report.plot import render  # matplotlib only when a picture is asked for

    target = out or Path(f"{run_id}-steps.png")
    render(picture, target, threshold=cli.config.settings.policy.straggler_threshold)
    flagged = ", ".join(str(r) for r in picture.flagged_ranks) or "none"
    slowest = max(picture.worst_window.items(), key=lambda item: item[1][0], default=None)
    window = ""
    if slowest is not None:
        rank, (ratio, first, last) = slowest
        window = f"; slowest rank {rank} at x{ratio:.2f} the median (steps {first}-{last})"
    typer.echo(
        f"wrote {target}: {len(picture.ranks)} ranks x {len(picture.columns)} columns "
        f"(steps {picture.columns[0][0]}-{picture.columns[-1][1]}); flagged ranks: {flagged}"
        + window
    )


def register(app: typer.Typer) -> None:
    app.command()(report)
