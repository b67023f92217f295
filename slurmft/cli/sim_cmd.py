"""`slurmft simulate` and `slurmft plan`: goodput at scale, from a simulator that runs the real
policy (docs/simulate.md)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from slurmft.cli.context import echo_json, state
from slurmft.errors import SlurmftError

GPUS_PER_NODE = Annotated[int, typer.Option("--gpus-per-node", min=1, help="GPUs on each node.")]
DAYS = Annotated[float, typer.Option("--days", min=0.01, help="Simulated horizon, in days.")]
COST = Annotated[
    float,
    typer.Option(
        "--checkpoint-cost",
        min=0.0,
        help="Seconds a durable checkpoint blocks training (default: asynchronous, 0.78 s as "
        "measured for Llama 3 70B on 1,856 GPUs; 30 for a synchronous one).",
    ),
]
WORKERS = Annotated[
    int | None,
    typer.Option("--workers", min=1, help="Processes side by side (default: every core)."),
]
JSON = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
INPUTS = Annotated[
    list[str] | None,
    typer.Option(
        "--input",
        help="Set any numeric input, NAME=NUMBER (repeatable), e.g. spare_swap_s=30, "
        "queue_wait_s=0, lemon_factor=10; docs/simulate.md lists them with their sources.",
        show_default=False,
    ),
]


def _nodes(gpus: int, gpus_per_node: int) -> int:
    if gpus % gpus_per_node:
        raise SlurmftError(f"--gpus {gpus} is not a whole number of {gpus_per_node}-GPU nodes")
    return gpus // gpus_per_node


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SlurmftError(
            f"{what}: expected comma-separated whole numbers, got {text!r}"
        ) from None
    if not values or any(v < 0 for v in values):
        raise SlurmftError(f"{what}: expected comma-separated whole numbers >= 0, got {text!r}")
    return values


def simulate(  # noqa: PLR0917 (typer: one parameter per option)
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs that train.")] = 16384,
    gpus_per_node: GPUS_PER_NODE = 8,
    days: DAYS = 7.0,
    strategies: Annotated[
        str,
        typer.Option(
            "--strategies",
            help="Comma-separated: requeue (every failure requeues the job), in_job (software "
            "faults and hangs restart in place, hardware requeues), ladder (slurmft).",
        ),
    ] = "requeue,in_job,ladder",
    spares: Annotated[
        str, typer.Option("--spares", help="Comma-separated spare counts to compare.")
    ] = "0,8,16,32",
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Seeds per setting.")] = 20,
    seed: Annotated[int, typer.Option("--seed", help="The first seed.")] = 0,
    checkpoint_cost: COST = 0.78,
    checkpoint_interval: Annotated[
        float | None,
        typer.Option(
            "--checkpoint-interval",
            min=1.0,
            help="Seconds of training between checkpoints (default: Young/Daly's optimum).",
        ),
    ] = None,
    meta_like: Annotated[
        bool,
        typer.Option(
            "--meta-like",
            help="Llama 3's published setting instead: requeue only, no spares, a dedicated "
            "cluster; a 3 s checkpoint every 5 minutes (the paper gives no cadence).",
        ),
    ] = False,
    sensitivity: Annotated[
        bool,
        typer.Option(
            "--sensitivity",
            help="Also the ladder's ETTR at the largest spare count over checkpoint costs "
            "(0.78, 3, 6.3, 30 s) and recovery times (x0.5, x1, x2).",
        ),
    ] = False,
    inputs: INPUTS = None,
    workers: WORKERS = None,
    as_json: JSON = False,
) -> None:
    """Simulate weeks of a training run at scale, each strategy at each spare count, many
    seeds: ETTR with 95 % confidence intervals, time lost by cause, spares used, drains,
    requeues and runs stopped. slurmft's ladder is decided by the real policy
    (slurmft.controller.decide), called at each control pass whose input changed. Failures are
    drawn from the Llama 3 table (419 interruptions, 54 days, 16,384 GPUs) with lemon nodes,
    rack switches, stragglers and hangs. docs/simulate.md gives every default's source."""
    from slurmft.sim.inputs import DAY, Inputs, Strategy, meta_like_inputs
    from slurmft.sim.report import format_rows, sensitivity_table, strategies_table

    try:
        chosen = [Strategy(s.strip()) for s in strategies.split(",") if s.strip()]
        if not chosen:
            raise ValueError(strategies)
    except ValueError:
        raise SlurmftError(
            f"--strategies: choose from {', '.join(s.value for s in Strategy)}; got {strategies!r}"
        ) from None
    counts = _ints(spares, "--spares")
    base = Inputs(
        nodes=_nodes(gpus, gpus_per_node),
        gpus_per_node=gpus_per_node,
        horizon_s=days * DAY,
        checkpoint_cost_s=checkpoint_cost,
        checkpoint_interval_s=checkpoint_interval,
        seed=seed,
    )
    if meta_like:
        base = meta_like_inputs(base)
        chosen, counts = [Strategy.REQUEUE], [0]
    base = base.with_settings(inputs or [])
    procs = workers or os.cpu_count() or 1
    rows = strategies_table(base, chosen, counts, seeds, procs)
    extra = []
    if sensitivity:
        ladder = base.with_(strategy=Strategy.LADDER, spares=max(counts))
        extra = sensitivity_table(
            ladder, (0.78, 3.0, 6.3, 30.0), (0.5, 1.0, 2.0), max(3, seeds // 2), procs
        )
    if as_json:
        echo_json({
            "table": [r.as_dict() for r in rows],
            "sensitivity": [r.as_dict() for r in extra],
        })  # fmt: skip
        return
    typer.echo(
        f"{base.gpus:,} GPUs ({base.nodes:,} nodes), {days:g} days, {seeds} seeds; "
        f"checkpoint cost {base.checkpoint_cost_s:g} s; rates: {base.rates.source}"
    )
    typer.echo(format_rows(rows))
    if extra:
        typer.echo(f"\nsensitivity: ladder, {max(counts)} spares")
        typer.echo(format_rows(extra, sensitivity=True))


def plan(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs that train.")],
    gpus_per_node: GPUS_PER_NODE = 8,
    days: DAYS = 7.0,
    checkpoint_cost: COST = 0.78,
    seeds: Annotated[int, typer.Option("--seeds", min=2, help="Seeds per choice.")] = 5,
    store: Annotated[
        bool,
        typer.Option(
            "--store",
            help="Failure rates from this store's own history (failures by class over the "
            "node-hours its allocations held) instead of the default table.",
        ),
    ] = False,
    min_failures: Annotated[
        int, typer.Option("--min-failures", min=1, help="With --store: refuse below this.")
    ] = 20,
    min_node_hours: Annotated[
        float, typer.Option("--min-node-hours", min=1.0, help="With --store: refuse below this.")
    ] = 5000.0,
    inputs: INPUTS = None,
    workers: WORKERS = None,
    as_json: JSON = False,
) -> None:
    """Recommend the spare count and the checkpoint interval for a run of --gpus GPUs, with
    the ETTR to expect for each choice: Young/Daly's interval first, refined by simulating the
    ladder (the real policy). Spares are chosen by goodput (ETTR x nodes / (nodes + spares)):
    a spare's GPUs do not train."""
    from slurmft.sim.inputs import DAY, Inputs
    from slurmft.sim.plan import StoreHistory, make_plan, rates_from_store

    base = Inputs(
        nodes=_nodes(gpus, gpus_per_node),
        gpus_per_node=gpus_per_node,
        horizon_s=days * DAY,
        checkpoint_cost_s=checkpoint_cost,
    ).with_settings(inputs or [])
    if store:
        history = _store_history(ctx)
        rates, stragglers = rates_from_store(
            StoreHistory(**history), min_failures=min_failures, min_node_hours=min_node_hours
        )
        base = base.with_(rates=rates, stragglers_per_node_day=stragglers)
    result = make_plan(base, seeds=seeds, workers=workers or os.cpu_count() or 1)
    data = result.as_dict()
    if as_json:
        echo_json(data)
        return
    _print_plan(data)


def _store_history(ctx: typer.Context) -> dict[str, Any]:
    from slurmft.db.history import planning_counts

    database = state(ctx).database()
    database.require_current()
    with database.session() as session:
        return planning_counts(session, now=datetime.now(UTC))


def _print_plan(data: dict[str, Any]) -> None:
    rates, rec = data["rates"], data["recommended"]
    low, high = data["mtbf_s_ci95"]
    typer.echo(f"{data['gpus']:,} GPUs ({data['nodes']:,} nodes); rates: {rates['source']}")
    typer.echo(
        f"  failures per node-hour {rates['per_node_hour']:.3g} (95 % CI "
        f"{rates['per_node_hour_ci95'][0]:.3g}-{rates['per_node_hour_ci95'][1]:.3g}); "
        f"job MTBF {data['mtbf_s'] / 3600:.2f} h ({low / 3600:.2f}-{high / 3600:.2f} h)"
    )
    cost, young, daly = data["checkpoint_cost_s"], data["young_interval_s"], data["daly_interval_s"]
    typer.echo(f"  checkpoint cost {cost:g} s: Young {young:.0f} s, Daly {daly:.0f} s")
    typer.echo("spares (at Daly's interval):")
    for c in data["spare_choices"]:
        typer.echo(f"  {c['spares']:>5}  {_pct(c['ettr'])} ETTR  {_pct(c['goodput'])} goodput  "
                   f"{c['counts']['requeues']['mean']:.1f} requeues")  # fmt: skip
    typer.echo(f"interval (at {rec['spares']} spares):")
    for c in data["interval_choices"]:
        typer.echo(f"  {c['interval_s']:>7.0f} s  {_pct(c['ettr'])} ETTR")
    typer.echo(
        f"recommended: {rec['spares']} spares, a checkpoint every "
        f"{rec['checkpoint_interval_s']:.0f} s: ETTR {_pct(rec['ettr'])}, "
        f"goodput {_pct(rec['goodput'])}"
    )


def _pct(e: dict[str, float]) -> str:
    return f"{100 * e['mean']:.2f} ± {100 * e['ci95']:.2f} %"


def register(app: typer.Typer) -> None:
    app.command()(simulate)
    app.command()(plan)
