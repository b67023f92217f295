"""`slurmft runs | status | events | cancel`: a user's runs, through the daemon's unix socket.

The daemon answers with the caller's own runs only (root sees all): it takes the uid from the
socket's peer credentials, never from the request.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from slurmft.cli.context import echo_json, state

JSON = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
RUN = Annotated[str, typer.Argument(help="Run id (see `slurmft runs`).")]


def ask(ctx: typer.Context, op: str, **args: Any) -> Any:
    # The socket client (and its socketserver) is loaded by a command that asks, not by every
    # `slurmft` start.
    from slurmft.controller.rpc import SOCKET_NAME, call

    return call(state(ctx).config.runtime_dir / SOCKET_NAME, op, **args)


def runs(ctx: typer.Context, as_json: JSON = False) -> None:
    """List your runs, newest first."""
    rows = ask(ctx, "runs")
    if as_json:
        echo_json(rows)
        return
    if not rows:
        typer.echo("no runs")
        return
    for r in rows:
        typer.echo(
            f"{r['run_id']:<14} {r['state']:<10} {r['nodes']}+{r['spares']} nodes  "
            f"job {r['job_id'] or '-':<8} {r['name']}"
        )


def status(ctx: typer.Context, run_id: RUN, as_json: JSON = False) -> None:
    """One run: its state, Slurm job, excluded nodes and the latest actions with reasons."""
    data = ask(ctx, "status", run_id=run_id)
    if as_json:
        echo_json(data)
        return
    typer.echo(
        f"{data['run_id']} {data['name']} ({data['owner']}): {data['state']}, "
        f"job {data['job_id'] or '-'}, attempt {data['attempts']}"
    )
    if data["end_reason"]:
        typer.echo(f"  ended: {data['end_reason']}")
    if data["excluded_nodes"]:
        typer.echo(f"  excluded nodes: {', '.join(data['excluded_nodes'])}")
    for notice in data.get("human_needed", []):
        typer.echo(f"  a person is needed ({notice['at']}): {notice['reason']}")
    for a in data["recent_actions"]:
        typer.echo(f"  {a['at']}  {a['kind']:<16} {a['status']:<8} {a['reason']}")


def events(
    ctx: typer.Context,
    run_id: RUN,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most N of each.")] = 100,
    as_json: JSON = False,
) -> None:
    """What happened to a run (events) and what slurmft did about it (actions)."""
    data = ask(ctx, "events", run_id=run_id, limit=limit)
    if as_json:
        echo_json(data)
        return
    for e in data["events"]:
        where = f" {e['node']}" if e["node"] else ""
        typer.echo(f"{e['at']}  event  {e['kind']}{where}: {e['message']}")
    for a in data["actions"]:
        typer.echo(f"{a['at']}  action {a['kind']} [{a['status']}]: {a['reason']}")


def cancel(ctx: typer.Context, run_id: RUN) -> None:
    """Cancel a run: the daemon cancels its Slurm job and ends the run."""
    ask(ctx, "cancel", run_id=run_id)
    typer.echo(f"cancel requested for {run_id}; `slurmft status {run_id}` shows when it ended")


def register(app: typer.Typer) -> None:
    for command in (runs, status, events, cancel):
        app.command()(command)
