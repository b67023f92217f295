"""`slurmft nodes [--json]` and `slurmft nodes release NODE`, through the daemon's socket."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from slurmft.cli.context import echo_json
from slurmft.cli.runs_cmd import JSON, ask

app = typer.Typer(
    help="The nodes slurmft knows: Slurm state, drains, denylist, failures, lemon standing.",
    invoke_without_command=True,
)


@app.callback()
def nodes(ctx: typer.Context, as_json: JSON = False) -> None:
    """Every node slurmft knows (in Slurm, on the denylist, or named by a failure): its Slurm
    state and drain (reason, by whom, when), its denylist entries (why, which run, when), its
    failures and whether it is a lemon. Any user may list them; a denylist entry names its run
    to that run's owner and to admins only."""
    if ctx.invoked_subcommand is not None:
        return
    data = ask(ctx, "nodes")
    if as_json:
        echo_json(data)
        return
    if data.get("slurm_error"):
        typer.echo(f"Slurm did not answer ({data['slurm_error']}): the store's view only")
    if not data["nodes"]:
        typer.echo("no nodes")
    for row in data["nodes"]:
        typer.echo(_line(row))
        for entry in row["denylist"]:
            run = f" run {entry['run_id']}" if entry["run_id"] else ""
            typer.echo(f"    denylisted ({entry['scope']}{run}) since {entry['added_at']}: "
                       f"{entry['reason']}")  # fmt: skip


def _line(row: dict[str, Any]) -> str:
    failures = row["failures"]
    parts = [f"{row['node']:<12} {row['state'] or 'not in Slurm':<22}"]
    if failures["failures"]:
        parts.append(
            f"{failures['failures']} failures ({failures['hardware_failures']} hardware) in "
            f"{failures['runs']} runs, last {failures['last_at']}"
        )
    if row["lemon"]["is_lemon"]:
        parts.append(f"LEMON: {row['lemon']['reason']}")
    drain = row["drain"]
    if drain:
        by = "slurmft" if drain["by_slurmft"] else drain["by"] or "?"
        parts.append(f"drained by {by} at {drain['at'] or '?'}: {drain['reason']}")
    return "  ".join(parts)


@app.command("release")
def release(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="The node's Slurm name.")],
    as_json: JSON = False,
) -> None:
    """Admins only: end the node's denylist entries and, if slurmft drained it or set it DOWN,
    resume it in Slurm (anyone else's drain or DOWN is left as it is). Each step is recorded as
    an action."""
    data = ask(ctx, "release_node", node=node)
    if as_json:
        echo_json(data)
        return
    typer.echo(
        f"{data['node']}: {data['denylist_entries_ended']} denylist entries ended; "
        f"{'resumed in Slurm' if data['resumed'] else 'not resumed'} ({data['why']})"
    )
