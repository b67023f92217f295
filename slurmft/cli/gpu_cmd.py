"""`slurmft gpu`: what the GPU probe sees on this node."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from slurmft.cli.context import echo_json, state

if TYPE_CHECKING:
    from slurmft.gpu import ProbeReport

app = typer.Typer(
    help="GPU health on this node (NVML, kernel-log Xids, DCGM).", no_args_is_help=True
)


@app.command("status")
def status(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    since_boot: Annotated[
        bool,
        typer.Option("--since-boot", help="Kernel-log Xids since boot, not only from now on."),
    ] = False,
) -> None:
    """Print every probe source, its status and the faults it sees, with their classification."""
    from slurmft.gpu import GpuProbe

    since = 0.0 if since_boot else None
    with GpuProbe.from_config(state(ctx).config, since_monotonic_s=since) as probe:
        report = probe.check()
    if as_json:
        echo_json(report.to_dict())
        return
    _print_text(report)


def _print_text(report: ProbeReport) -> None:
    if report.no_gpu:
        typer.echo(f"no GPU: {report.no_gpu_reason}")
    for source in report.sources:
        reason = f" ({source.reason})" if source.reason else ""
        typer.echo(f"{source.source:<11} {source.status}{reason}")
        for gpu in source.gpus:
            typer.echo(f"  GPU {gpu}")
    if not report.faults:
        typer.echo("no GPU faults")
        return
    for fault in report.faults:
        where = f"GPU {fault.gpu}" if fault.gpu is not None else (fault.pci_bus or "node")
        xid = f"Xid {fault.xid} " if fault.xid is not None else ""
        typer.echo(f"{fault.action:<11} {where:<8} {xid}{fault.summary}  [{fault.source}]")
    drain = report.drain_reason()
    typer.echo(f"verdict: drain this node: {drain}" if drain else f"verdict: {report.action}")
