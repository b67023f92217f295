"""`slurmft submit`: a training run as one Slurm job of N nodes plus S warm spares.

The job is submitted by this process, so it belongs to the calling user. The daemon records the
run (its owner comes from the socket's peer credentials) and hands out the run's token, which
is written where only the user can read it; the agents present it when they report.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from slurmft.cli.context import echo_json, state

if TYPE_CHECKING:
    from slurmft.api import SubmissionPlan
    from slurmft.controller.spec import RunSpec

# The batch script, the run spec and the Slurm client (slurmft.api) are loaded when a run is
# submitted, not by every `slurmft` start that builds this command's options.


def _spec_from(
    spec_file: Path | None, script: list[str], options: dict[str, Any], added: dict[str, Any]
) -> RunSpec:
    """The spec file's fields, the flags over them, and the repeatable flags' values after the
    file's (its [env] under --env's)."""
    from slurmft.api.submission import default_name
    from slurmft.controller.spec import RunSpec, SpecError

    if spec_file is not None:
        data = RunSpec.from_toml(spec_file).to_dict()
        data |= {k: v for k, v in options.items() if v is not None}
        if script:
            data["script"] = script
        where = str(spec_file)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("nodes", "ckpt_dir") if options[k] is None]
        if missing:
            raise SpecError(f"missing {' and '.join(missing)} (or give a --spec file)")
        fields = {k: v for k, v in options.items() if v is not None}
        data = {"name": default_name(script), "script": script, **fields}
        where = "spec"
    for name, values in added.items():
        base = data.get(name) or ({} if name == "env" else [])
        data[name] = base | values if name == "env" else [*base, *values]
    return RunSpec.from_dict(data, where=where)


def _added_lists(
    sbatch_arg: list[str] | None,
    srun_arg: list[str] | None,
    setup: list[str] | None,
    env: list[str] | None,
) -> dict[str, Any]:
    from slurmft.controller.spec import SpecError
    from slurmft.slurm import passthrough
    from slurmft.slurm.api import SlurmBadRequest

    try:
        words = {"sbatch_args": passthrough.split_args(sbatch_arg or ()),
                 "srun_args": passthrough.split_args(srun_arg or ())}  # fmt: skip
    except SlurmBadRequest as error:
        raise SpecError(str(error)) from None
    added: dict[str, Any] = {name: value for name, value in words.items() if value}
    if setup:
        added["setup"] = list(setup)
    if env:
        added["env"] = dict(_env_pair(item) for item in env)
    return added


def _env_pair(item: str) -> tuple[str, str]:
    """`--env NAME=VALUE`, or `--env NAME`: its value in this shell, now (stored with the run)."""
    from slurmft.controller.spec import SpecError

    name, has_value, value = item.partition("=")
    if has_value:
        return name, value
    if name not in os.environ:
        raise SpecError(f"--env {name}: not set here; give --env {name}=VALUE")
    return name, os.environ[name]


def submit(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    script: Annotated[
        list[str] | None,
        typer.Argument(help="The training script and its arguments (after `--`), as for torchrun."),
    ] = None,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="A TOML run spec; flags override its fields.")
    ] = None,
    nodes: Annotated[int | None, typer.Option(help="Training nodes N.")] = None,
    spares: Annotated[int | None, typer.Option(help="Warm spare nodes S (default 1).")] = None,
    nproc_per_node: Annotated[
        str | None,
        typer.Option(
            help="Worker processes per node: a number, or gpu (the GPUs Slurm gives each node). "
            "Default: gpu when GPUs are asked for, else 1."
        ),
    ] = None,
    ckpt_dir: Annotated[
        str | None, typer.Option(help="Shared checkpoint directory (every node mounts it).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Run name (default: the script's).")] = None,
    time_limit: Annotated[
        str | None, typer.Option("--time", help="Slurm time limit, e.g. 2-00:00:00.")
    ] = None,
    partition: Annotated[str | None, typer.Option(help="Slurm partition.")] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(help="GPUs per node (sbatch --gpus-per-node; every agent step too)."),
    ] = None,
    gres: Annotated[
        str | None, typer.Option(help="Generic resources per node, e.g. gpu:a100:8.")
    ] = None,
    account: Annotated[str | None, typer.Option(help="Slurm account to charge.")] = None,
    qos: Annotated[str | None, typer.Option(help="Slurm quality of service.")] = None,
    constraint: Annotated[
        str | None, typer.Option(help="Node features, e.g. a100&ib (sbatch --constraint).")
    ] = None,
    mem: Annotated[str | None, typer.Option(help="Memory per node, e.g. 500G (0: all).")] = None,
    exclusive: Annotated[
        bool | None,
        typer.Option("--exclusive/--shared", help="Whole nodes only (sbatch --exclusive)."),
    ] = None,
    reservation: Annotated[str | None, typer.Option(help="Slurm reservation.")] = None,
    cpus_per_task: Annotated[
        int | None, typer.Option(help="CPUs for each node's agent and its workers.")
    ] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(
            help="A site's own sbatch option, e.g. --sbatch-arg=--mail-type=END "
            "(repeatable; docs/submit.md lists what slurmft refuses and why)."
        ),
    ] = None,
    srun_arg: Annotated[
        list[str] | None,
        typer.Option(
            help="An option for every agent step's srun, e.g. --srun-arg=--mpi=none (repeatable)."
        ),
    ] = None,
    setup: Annotated[
        list[str] | None,
        typer.Option(
            help="A shell line run in the batch script and before every agent, e.g. "
            "'module load cuda/12.4' (repeatable, in order)."
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            help="NAME=VALUE, or NAME for its value here, in the job's "
            "environment on every attempt (repeatable). Nothing else of this shell's "
            "environment reaches the job.",
        ),
    ] = None,
    python: Annotated[
        str | None,
        typer.Option(
            help="The interpreter the job runs slurmft, torchrun and the workers with. "
            "Default: the active venv's (VIRTUAL_ENV) or conda env's (CONDA_PREFIX), "
            "else slurmft's own; checked here to import slurmft.train and to have torch."
        ),
    ] = None,
    container_image: Annotated[
        str | None, typer.Option(help="pyxis/enroot image for the agents (srun --container-image).")
    ] = None,
    container_mounts: Annotated[
        str | None, typer.Option(help="pyxis mounts, e.g. /shared:/shared (with an image).")
    ] = None,
    container_workdir: Annotated[
        str | None, typer.Option(help="pyxis working directory inside the image.")
    ] = None,
    apptainer: Annotated[
        str | None,
        typer.Option(
            help="Apptainer/Singularity image: agents run under "
            "`apptainer exec --nv --bind <ckpt-dir> IMAGE`."
        ),
    ] = None,
    container_wrapper: Annotated[
        str | None,
        typer.Option(
            help="Any command the agents run under, as shell words, e.g. "
            "'bwrap --unshare-pid --ro-bind / / --bind /shared /shared'."
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the batch script, sbatch's argv and the agent "
            "step's srun argv; submit nothing.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Submit a training run: `slurmft submit --nodes 3 --ckpt-dir /shared/ck -- train.py`.

    The job runs in a clean environment (HOME, USER, SHELL, PATH, SLURM_CONF) plus what --env,
    the spec's env table and --setup give it, the same on every requeue and resubmission.
    """
    from slurmft.api import plan_submission
    from slurmft.api import submit as submit_run
    from slurmft.api.submission import spec_file_sets

    options: dict[str, object] = {
        "nodes": nodes,
        "spares": spares,
        "nproc_per_node": nproc_per_node,
        "ckpt_dir": ckpt_dir,
        "name": name,
        "time_limit": time_limit,
        "partition": partition,
        "gpus_per_node": gpus_per_node,
        "gres": gres,
        "account": account,
        "qos": qos,
        "constraint": constraint,
        "mem": mem,
        "exclusive": exclusive,
        "reservation": reservation,
        "cpus_per_task": cpus_per_task,
        "python": python,
        "container_image": container_image,
        "container_mounts": container_mounts,
        "container_workdir": container_workdir,
        "apptainer": apptainer,
        "container_wrapper": container_wrapper,
    }
    if nproc_per_node is not None and nproc_per_node.isascii() and nproc_per_node.isdigit():
        options["nproc_per_node"] = int(nproc_per_node)
    added = _added_lists(sbatch_arg, srun_arg, setup, env)
    spec = _spec_from(spec_file, list(script or []), options, added)
    explicit_spares = spares is not None or spec_file_sets(spec_file, "spares")
    config = state(ctx).config
    if dry_run:
        plan = plan_submission(spec, config=config, spares_explicit=explicit_spares, on_note=_note)
        _print_plan(plan, as_json=as_json)
        return
    run = submit_run(spec, config=config, spares_explicit=explicit_spares, on_note=_note)
    if as_json:
        echo_json({"run_id": run.run_id, "job_id": run.job_id})
    else:
        assert run.spec is not None
        typer.echo(
            f"run {run.run_id} submitted as Slurm job {run.job_id} "
            f"({run.spec.nodes} nodes + {run.spec.spares} spares); `slurmft status {run.run_id}`"
        )


def _note(text: str) -> None:
    typer.echo(text, err=True)


def _print_plan(plan: SubmissionPlan, *, as_json: bool) -> None:
    """`submit --dry-run`: what would be sent, with the daemon's parts as placeholders."""
    if as_json:
        echo_json(plan.to_dict())
        return
    typer.echo(f"# sbatch (the script on its stdin)\n{shlex.join(plan.sbatch_argv)}\n")
    typer.echo(f"# the batch script\n{plan.batch_script}")
    typer.echo(
        f"# the agent step (first launch; again after every loss)\n{shlex.join(plan.srun_argv)}"
    )


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(submit)
