"""`slurmft submit`: a training run as one Slurm job of N nodes plus S warm spares.

The job is submitted by this process, so it belongs to the calling user. The daemon records the
run (its owner comes from the socket's peer credentials) and hands out the run's token, which
is written where only the user can read it; the agents present it when they report.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from slurmft.cli.context import echo_json, state

if TYPE_CHECKING:
    from slurmft.config import Config
    from slurmft.controller.spec import RunSpec
    from slurmft.slurm.api import SubmitRequest

# The batch script, the run spec and the Slurm client are loaded when a run is submitted, not
# by every `slurmft` start that builds this command's options.

TOKEN_DIR = ".slurmft"  # slurmft.agent.state_dir.STATE_DIR


def _slurmft_executable() -> str:
    """The slurmft the compute nodes run: this one (same venv on a shared filesystem)."""
    here = Path(sys.argv[0])
    if here.name == "slurmft" and here.exists():
        return str(here.resolve())
    return shutil.which("slurmft") or str(Path(sys.executable).with_name("slurmft"))


def _write_token(ckpt_dir: str, token: str) -> Path:
    """The run's token, readable by its owner only, where every node of the job can read it
    (in a private ``<ckpt>/.slurmft``, never through a link: slurmft.agent.state_dir)."""
    from slurmft.agent.state_dir import write_token

    return write_token(ckpt_dir, token)


def _spec_from(spec_file: Path | None, script: list[str], options: dict[str, Any]) -> RunSpec:
    from slurmft.controller.spec import RunSpec, SpecError

    if spec_file is not None:
        data = RunSpec.from_toml(spec_file).to_dict()
        data |= {k: v for k, v in options.items() if v is not None}
        if script:
            data["script"] = script
        return RunSpec.from_dict(data, where=str(spec_file))
    missing = [f"--{k.replace('_', '-')}" for k in ("nodes", "ckpt_dir") if options[k] is None]
    if missing:
        raise SpecError(f"missing {' and '.join(missing)} (or give a --spec file)")
    fields = {k: v for k, v in options.items() if v is not None}
    return RunSpec.from_dict({"name": _default_name(script), "script": script, **fields})


def _spec_file_sets(spec_file: Path | None, field: str) -> bool:
    import tomllib

    return spec_file is not None and field in tomllib.loads(spec_file.read_text())


def _spares_for_this_torch(spec: RunSpec, *, explicit: bool) -> RunSpec:
    """Hot spares need the wait-list fix, which knows only some torch releases: with another
    torch a run asked for spares is refused, and one that took the default runs without."""
    from dataclasses import replace

    from slurmft.controller.spec import SpecError
    from slurmft.core import torch_support

    version = torch_support.installed_version()
    if spec.spares and not torch_support.spares_work_with(version):
        known = ", ".join(torch_support.patch(torch_support.WAIT_LIST_FIX).known)
        why = f"hot spares need the wait-list fix, which knows torch {known}, not {version}"
        if explicit:
            raise SpecError(
                f"spares = {spec.spares}: {why}; ask for 0 spares, or use torch {known}"
            )
        typer.echo(f"note: running without spares: {why}", err=True)
        spec = replace(spec, spares=0)
    for warning in torch_support.warnings_for(version, spec.spares):
        typer.echo(warning, err=True)
    return spec


def _default_name(script: list[str]) -> str:
    """`train.py ...` -> train; `-m pkg.train ...` -> train. Characters a run name may not hold
    become `_`: the name is slurmft's choice, so it never is what the spec refuses."""
    if len(script) >= 2 and script[0] == "-m":
        name = script[1].rsplit(".", 1)[-1]
    else:
        name = Path(script[0]).stem if script else "run"
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name, flags=re.ASCII)[:100] or "run"


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
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Submit a training run: `slurmft submit --nodes 3 --ckpt-dir /shared/ck -- train.py`."""
    from slurmft.agent.state_dir import check_state_dir
    from slurmft.controller.resubmit import submission_record
    from slurmft.controller.rpc import SOCKET_NAME, call
    from slurmft.errors import SlurmftError

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
    }
    if nproc_per_node is not None and nproc_per_node.isascii() and nproc_per_node.isdigit():
        options["nproc_per_node"] = int(nproc_per_node)
    spec = _spec_from(spec_file, list(script or []), options)
    explicit_spares = spares is not None or _spec_file_sets(spec_file, "spares")
    spec = _spares_for_this_torch(spec, explicit=explicit_spares)
    cli = state(ctx)
    # Refused before the run exists: a checkpoint directory whose .slurmft someone else made.
    check_state_dir(spec.ckpt_dir)
    socket_path = cli.config.runtime_dir / SOCKET_NAME
    created = call(socket_path, "create_run", spec=spec.to_dict())
    run_id = created["run_id"]
    try:
        job_id, request = _submit_job(cli.config, spec, created)
    except Exception as exc:  # whatever failed, the run must not stay pending for ever
        known = isinstance(exc, SlurmftError | OSError)
        why = str(exc) if known else f"{type(exc).__name__}: {exc}"
        call(socket_path, "fail_run", run_id=run_id, reason=f"submission failed: {why}")
        raise
    # The daemon keeps what was sent, to send it again (as this user) if Slurm cannot requeue it.
    submission = submission_record(request, workdir=os.getcwd(), path=os.environ.get("PATH", ""))
    call(socket_path, "attach_job", run_id=run_id, job_id=job_id, submission=submission)
    if as_json:
        echo_json({"run_id": run_id, "job_id": job_id})
    else:
        typer.echo(
            f"run {run_id} submitted as Slurm job {job_id} "
            f"({spec.nodes} nodes + {spec.spares} spares); `slurmft status {run_id}`"
        )


def _submit_job(
    config: Config, spec: RunSpec, created: dict[str, Any]
) -> tuple[str, SubmitRequest]:
    from slurmft.agent.batch import BatchSpec, job_script, submit_request
    from slurmft.slurm import CliSlurmClient
    from slurmft.slurm.script import job_name_for

    token_file = _write_token(spec.ckpt_dir, created["token"])
    batch = BatchSpec(
        run_id=created["run_id"],
        nodes=spec.nodes,
        spares=spec.spares,
        script=spec.script,
        ckpt_dir=spec.ckpt_dir,
        nproc_per_node=spec.workers_per_node,
        step_gres=spec.step_gres,
        cpus_per_task=spec.cpus_per_task,
        store_port=0,  # the batch step takes a free port on its node
        max_restarts_without_progress=config.settings.policy.max_restarts_without_progress,
        slurmft=_slurmft_executable(),
        token_file=str(token_file),
    )
    env = {**spec.env, "SLURMFT_AGENT_CONTROLLER_URL": created["controller_url"]}
    if created.get("ca_file"):  # an https ingest: the CA the agents verify it against
        env["SLURMFT_AGENT_CA_FILE"] = created["ca_file"]
    request = submit_request(
        batch,
        job_name=job_name_for(spec.name),
        time_limit=spec.time_limit,
        save_lead_s=spec.save_lead_s,
        exclude=created["exclude"],
        partition=spec.partition,
        output=str(Path(spec.ckpt_dir) / TOKEN_DIR / "slurm-%j.out"),
        site=spec.site_options(),
    )
    request = replace(request, script=job_script(batch, env))
    slurm = config.settings.slurm
    client = CliSlurmClient(slurm_conf=slurm.conf or None, timeout_s=slurm.command_timeout_s)
    return client.submit(request), request


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(submit)
