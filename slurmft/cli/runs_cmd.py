"""`slurmft runs | status | events | cancel`: a user's runs, through the daemon's unix socket.

The daemon answers with the caller's own runs only (root sees all): it takes the uid from the
socket's peer credentials, never from the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from slurmft.cli.context import echo_json, state

if TYPE_CHECKING:
    from slurmft.api import Run, RunStatus, RunSummary, TimelineEntry

JSON = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
RUN = Annotated[str, typer.Argument(help="Run id (see `slurmft runs`).")]


def ask(ctx: typer.Context, op: str, **args: Any) -> Any:
    # The socket client (and its socketserver) is loaded by a command that asks, not by every
    # `slurmft` start.
    from slurmft.controller.rpc import SOCKET_NAME, call

    return call(state(ctx).config.runtime_dir / SOCKET_NAME, op, **args)


STATES = Annotated[
    list[str] | None,
    typer.Option(
        "--state",
        help="Only runs in this state (repeat for several): pending, running, recovering, "
        "completed, failed, cancelled, stopped.",
    ),
]
SINCE = Annotated[
    str | None,
    typer.Option(
        "--since",
        help="Only runs created since: an ISO 8601 time (UTC unless it says) or an age such "
        "as 90m, 6h or 3d.",
    ),
]
USER = Annotated[
    str | None,
    typer.Option("--user", help="Only this user's runs (an admin's option; others see theirs)."),
]
AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_time(value: str, now: datetime | None = None) -> str:
    """``--since`` as an ISO 8601 UTC time: an age (``90m``, ``6h``, ``3d``) or a time."""
    now = now or datetime.now(UTC)
    text = value.strip()
    if text[:-1].isdigit() and text[-1:] in AGES:
        return (now - timedelta(seconds=int(text[:-1]) * AGES[text[-1]])).isoformat()
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r}: an ISO 8601 time (2026-12-01, 2026-12-01T08:00) or an age (90m, 6h, 3d)",
            param_hint="--since",
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).isoformat()


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _run(ctx: typer.Context, run_id: str) -> Run:
    from slurmft.api import Run

    return Run(run_id, config=state(ctx).config)


def run_line(r: RunSummary) -> str:
    """One run on one line: where it is, its budget and its effective ratio so far."""
    return (
        f"{r.run_id:<14} {r.state:<10} {r.nodes}+{r.spares} "
        f"job {r.job_id or '-':<8} step {_or_dash(r.step):<7} "
        f"world {_or_dash(r.world_size):<4} restarts {r.restarts}/{r.restart_cap}  "
        f"effective {_ratio(r.effective_ratio)}  {r.name}"
    )


def runs(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    states: STATES = None,
    since: SINCE = None,
    user: USER = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000, help="At most N runs.")] = 200,
    as_json: JSON = False,
) -> None:
    """List your runs, newest first: state, nodes+spares, Slurm job, step, world size,
    restarts without progress against the cap, and the effective ratio so far."""
    from slurmft.api import runs as list_runs

    rows = list_runs(
        states=states or (),
        since=None if since is None else since_time(since),
        user=user,
        limit=limit,
        config=state(ctx).config,
    )
    if as_json:
        echo_json([r.to_dict() for r in rows])
        return
    if not rows:
        typer.echo("no runs")
        return
    for r in rows:
        typer.echo(run_line(r))


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _progress_lines(data: RunStatus) -> list[str]:
    lines = []
    if data.step is not None:
        lines.append(f"step {data.step}, world size {data.world_size} ranks")
    elif data.state in ("running", "recovering"):
        lines.append("step unknown: the script does not report steps (node-level supervision)")
    ckpt = data.checkpoint
    if ckpt is None:
        lines.append("checkpoint: none reported yet")
    else:
        what = f"step {ckpt.step}" if ckpt.verified else f"{ckpt.label} (found on disk)"
        lines.append(f"checkpoint: {what}, {_age(ckpt.age_s)} old")
    if data.spares_left is not None:
        lines.append(f"spares left: {data.spares_left} of {data.spares}")
    lines.append(f"restarts without progress: {data.restarts} of {data.restart_cap}")
    effective = data.effective
    if effective is not None:
        lines.append(
            f"effective ratio so far: {_ratio(effective.ratio)} (wall {effective.wall_s:.0f}"
            f" s, lost {effective.lost_s:.0f} s)"
        )
    lines.append(f"now: {data.doing}")
    return lines


def status(ctx: typer.Context, run_id: RUN, as_json: JSON = False) -> None:
    """Where one run is: state, Slurm job, step and world size, the newest checkpoint and its
    age, spares left, restarts against the cap, the effective ratio so far, what slurmft is
    doing now, excluded nodes and the latest actions with their reasons."""
    data = _run(ctx, run_id).status()
    if as_json:
        echo_json(data.to_dict())
        return
    typer.echo(
        f"{data.run_id} {data.name} ({data.owner}): {data.state}, "
        f"job {data.job_id or '-'}, attempt {data.attempts}"
    )
    for line in _progress_lines(data):
        typer.echo(f"  {line}")
    if data.held:
        typer.echo(
            f"  HELD: the daemon's control pass failed for this run {data.control_failures} "
            f"passes in a row ({data.control_error}); only a cancel is carried out until an "
            f"admin runs `slurmft release-run {data.run_id}`"
        )
    elif data.control_failures:
        failing = f"{data.control_failures} in a row"
        typer.echo(f"  control pass failing ({failing}): {data.control_error}")
    if data.end_reason:
        typer.echo(f"  ended: {data.end_reason}")
    if data.excluded_nodes:
        typer.echo(f"  excluded nodes: {', '.join(data.excluded_nodes)}")
    for notice in data.human_needed:
        typer.echo(f"  a person is needed ({_shown(notice.at)}): {notice.reason}")
    for a in data.recent_actions:
        typer.echo(f"  {_shown(a.at)}  {a.kind:<16} {a.status:<8} {a.reason}")


def _shown(at: datetime) -> str:
    """A time as the daemon sent it (ISO 8601, its own precision)."""
    return at.isoformat()


def _few(items: Sequence[object], shown: int) -> str:
    """The first ``shown`` of ``items``, and how many more."""
    more = f",+{len(items) - shown}" if len(items) > shown else ""
    return ",".join(map(str, items[:shown])) + more


def entry_line(e: TimelineEntry) -> str:
    """One timeline entry: an event (what happened) or an action (what slurmft did)."""
    where = f" {_few(e.nodes, 4)}" if e.nodes else ""
    if e.ranks:
        where += f" rank{'s' if len(e.ranks) > 1 else ''} {_few(e.ranks, 8)}"
    count = f" x{e.count}" if e.count > 1 else ""
    status = f" [{e.status}]" if e.status else ""
    return f"{_shown(e.at)}  {e.source:<6} {e.kind}{count}{status}{where}: {e.text}"


def events(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    run_id: RUN,
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=10_000, help="At most N events and N actions.")
    ] = 100,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new entries until the run ends.")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="Seconds between asks with --follow.")
    ] = 1.0,
    as_json: JSON = False,
) -> None:
    """One timeline of a run: what happened (events) and what slurmft did about it (actions,
    with status and reason), in time order. Reports of one thing from many ranks or nodes are
    one line with their count (x N). With --json and --follow: one JSON object per line."""
    import json

    run = _run(ctx, run_id)
    if as_json and not follow:
        echo_json(run.events(limit).to_dict())
        return
    entries = run.follow(limit, interval_s=interval) if follow else run.events(limit).entries
    try:
        for entry in entries:
            line = json.dumps(entry.to_dict(), sort_keys=True) if as_json else entry_line(entry)
            typer.echo(line)
    except KeyboardInterrupt:
        return


def cancel(ctx: typer.Context, run_id: RUN) -> None:
    """Cancel a run: the daemon cancels its Slurm job and ends the run."""
    _run(ctx, run_id).cancel()
    typer.echo(f"cancel requested for {run_id}; `slurmft status {run_id}` shows when it ended")


def release_run(ctx: typer.Context, run_id: RUN) -> None:
    """Let the control pass try a held run again (admins only). A run is held when its part
    of the daemon's control pass failed three passes in a row; `slurmft status RUN` says why.
    Mend the cause first, or it is held again three passes later."""
    released = _run(ctx, run_id).release()
    typer.echo(f"{run_id} released: the next control pass tries it again" if released
               else f"{run_id} is not held; nothing to release")


def register(app: typer.Typer) -> None:
    for command in (runs, status, events, cancel):
        app.command()(command)
    app.command("release-run")(release_run)
