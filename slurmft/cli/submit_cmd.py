"""`slurmft submit`: a training run as one Slurm job of N nodes plus S warm spares.

The job is submitted by this process, so it belongs to the calling user. The daemon records the
run (its owner comes from the socket's peer credentials) and hands out the run's token, which
is written where only the user can read it; the agents present it when they report.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from slurmft.cli.context import echo_json, state

if TYPE_CHECKING:
    from slurmft.agent.batch import BatchSpec
    from slurmft.config import Config
    from slurmft.controller.spec import RunSpec
    from slurmft.slurm.api import SubmitRequest

# The batch script, the run spec and the Slurm client are loaded when a run is submitted, not
# by every `slurmft` start that builds this command's options.

TOKEN_DIR = ".slurmft"  # slurmft.agent.state_dir.STATE_DIR


def _write_token(ckpt_dir: str, token: str) -> Path:
    """The run's token, readable by its owner only, where every node of the job can read it
    (in a private ``<ckpt>/.slurmft``, never through a link: slurmft.agent.state_dir)."""
    from slurmft.agent.state_dir import write_token

    return write_token(ckpt_dir, token)


def _spec_from(
    spec_file: Path | None, script: list[str], options: dict[str, Any], added: dict[str, Any]
) -> RunSpec:
    """The spec file's fields, the flags over them, and the repeatable flags' values after the
    file's (its [env] under --env's)."""
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
        data = {"name": _default_name(script), "script": script, **fields}
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


def _with_python(spec: RunSpec) -> RunSpec:
    """The job's interpreter: the one given, else the active environment's (a container's:
    `python3` on its PATH)."""
    from slurmft.cli.job_python import CONTAINER_PYTHON, default_python

    if spec.python is not None:
        return spec
    return replace(spec, python=CONTAINER_PYTHON if spec.in_container else default_python())


def _checked_torch(spec: RunSpec) -> str | None:
    """The job's torch version, from its interpreter (None where it cannot be run here: the
    login host's own torch, if any, stands in)."""
    from slurmft.cli.job_python import check_python
    from slurmft.core import torch_support

    assert spec.python is not None
    checked = check_python(spec.python, spec.agent_wrapper, pyxis=spec.container_image is not None)
    if checked.warning:
        typer.echo(checked.warning, err=True)
    return checked.torch if checked.torch is not None else torch_support.installed_version()


def _note_plugin_options(spec: RunSpec) -> None:
    """Options Slurm 22.05 does not have are passed on: say so (a typo reaches sbatch)."""
    from slurmft.slurm import passthrough

    notes = [*passthrough.parse("sbatch", spec.sbatch_args).notes,
             *passthrough.parse("srun", spec.srun_args).notes]  # fmt: skip
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def _note_ignored_environment() -> None:
    """sbatch's input variables are not passed on: a resubmission could not repeat them."""
    ignored = sorted(name for name in os.environ if name.startswith(("SBATCH_", "SLURM_"))
                     and name != "SLURM_CONF")  # fmt: skip
    if ignored:
        typer.echo(
            f"note: not passed to sbatch (a resubmission could not repeat them): "
            f"{', '.join(ignored)}; use the flags, --sbatch-arg or --env",
            err=True,
        )


def _spec_file_sets(spec_file: Path | None, field: str) -> bool:
    import tomllib

    return spec_file is not None and field in tomllib.loads(spec_file.read_text())


def _spares_for_this_torch(spec: RunSpec, *, explicit: bool, version: str | None) -> RunSpec:
    """Hot spares need the wait-list fix, which knows only some torch releases: with another
    torch a run asked for spares is refused, and one that took the default runs without."""
    from slurmft.controller.spec import SpecError
    from slurmft.core import torch_support

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
            "else slurmft's own; checked here to import slurmft.train and torch."
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
    spec = _with_python(spec)
    explicit_spares = spares is not None or _spec_file_sets(spec_file, "spares")
    spec = _spares_for_this_torch(spec, explicit=explicit_spares, version=_checked_torch(spec))
    _note_ignored_environment()
    _note_plugin_options(spec)
    cli = state(ctx)
    if dry_run:
        _print_plan(cli.config, spec, as_json=as_json)
        return
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


def _plan(
    config: Config, spec: RunSpec, created: dict[str, Any], token_file: str
) -> tuple[BatchSpec, SubmitRequest]:
    """The batch step's plan and sbatch's request for this run (nothing is run)."""
    from slurmft.agent.batch import BatchSpec, job_script, submit_request
    from slurmft.slurm import passthrough
    from slurmft.slurm.script import job_name_for

    assert spec.python is not None
    srun_args = passthrough.check("srun", [*spec.container_options, *spec.srun_args])
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
        token_file=token_file,
        # In a container the batch step and the rendezvous store stay outside, with this
        # slurmft's interpreter; the agents use the image's.
        python=sys.executable if spec.in_container else spec.python,
        agent_python=spec.python if spec.in_container else "",
        agent_wrapper=spec.agent_wrapper,
        setup=spec.setup,
        srun_args=srun_args,
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
        site={**spec.site_options(), "sbatch_args": spec.sbatch_args},
    )
    return batch, replace(request, script=job_script(batch, env))


def _submit_job(
    config: Config, spec: RunSpec, created: dict[str, Any]
) -> tuple[str, SubmitRequest]:
    import pwd

    from slurmft.controller.resubmit import submit_environment
    from slurmft.slurm import CliSlurmClient
    from slurmft.slurm.runner import SubprocessRunner

    token_file = _write_token(spec.ckpt_dir, created["token"])
    _, request = _plan(config, spec, created, str(token_file))
    slurm = config.settings.slurm
    # The environment a resubmission has too: nothing of this shell leaks into the job.
    owner = pwd.getpwuid(os.getuid())
    env = submit_environment(owner, os.environ.get("PATH", ""), slurm.conf or None)
    client = CliSlurmClient(SubprocessRunner(env, inherit=False), timeout_s=slurm.command_timeout_s)
    return client.submit(request), request


DRY_RUN_ID = "dry-run"


def _print_plan(config: Config, spec: RunSpec, *, as_json: bool) -> None:
    """`submit --dry-run`: what would be sent, with the daemon's parts as placeholders."""
    from slurmft.agent.batch import srun_argv
    from slurmft.agent.state_dir import TOKEN_FILE
    from slurmft.slurm.commands import submit_argv

    created = {
        "run_id": DRY_RUN_ID,
        "controller_url": "<the daemon's agents_url>",
        "exclude": [],
    }
    token_file = str(Path(spec.ckpt_dir) / TOKEN_DIR / TOKEN_FILE)
    batch, request = _plan(config, spec, created, token_file)
    count = spec.nodes + spec.spares
    agent = batch.agent_argv("<batch host>", outcome_dir="<ckpt>/.slurmft/steps/<job>.<launch>")
    placeholders = [f"node{i}" for i in range(count)]
    srun = [
        f"--nodelist=<the job's {count} nodes>" if word.startswith("--nodelist=") else word
        for word in srun_argv(placeholders, agent, batch.step_options())
    ]
    plan = {"batch_script": request.script, "sbatch_argv": submit_argv(request), "srun_argv": srun}
    if as_json:
        echo_json(plan)
        return
    typer.echo(f"# sbatch (the script on its stdin)\n{shlex.join(plan['sbatch_argv'])}\n")
    typer.echo(f"# the batch script\n{request.script}")
    typer.echo(f"# the agent step (first launch; again after every loss)\n{shlex.join(srun)}")


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(submit)
