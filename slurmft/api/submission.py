"""Submitting a run from Python: `submit(spec) -> Run` and `plan_submission(spec)`.

`slurmft submit` builds a spec from its flags and calls these; they check the spec as the CLI
does (the same `RunSpec`, the job's interpreter, torch's support for spares, the checkpoint
directory's private `.slurmft`), then the daemon records the run and this process submits the
job, so the job belongs to the caller.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurmft.api.run import Run, _ask, _socket

if TYPE_CHECKING:
    from slurmft.agent.batch import BatchSpec
    from slurmft.config import Config
    from slurmft.controller.spec import RunSpec
    from slurmft.slurm.api import SubmitRequest

TOKEN_DIR = ".slurmft"  # slurmft.agent.state_dir.STATE_DIR
DRY_RUN_ID = "dry-run"

Note = Callable[[str], None]


class SubmitNote(UserWarning):
    """Something about a submission the caller should know (spares dropped for this torch, an
    option passed on to sbatch unchecked); `submit` warns with it unless given ``on_note``."""


def _warn(text: str) -> None:
    """Warn as from the caller's line that called into slurmft (not from slurmft's own)."""
    depth, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("slurmft."):
        depth, frame = depth + 1, frame.f_back
    warnings.warn(text, SubmitNote, stacklevel=depth)


@dataclass(frozen=True)
class SubmissionPlan:
    """What `submit` would send, with the daemon's parts as placeholders (`--dry-run`)."""

    batch_script: str
    sbatch_argv: list[str]
    srun_argv: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"batch_script": self.batch_script, "sbatch_argv": self.sbatch_argv,
                "srun_argv": self.srun_argv}  # fmt: skip


def default_name(script: list[str] | tuple[str, ...]) -> str:
    """`train.py ...` -> train; `-m pkg.train ...` -> train. Characters a run name may not hold
    become `_`: the name is slurmft's choice, so it never is what the spec refuses."""
    if len(script) >= 2 and script[0] == "-m":
        name = script[1].rsplit(".", 1)[-1]
    else:
        name = Path(script[0]).stem if script else "run"
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name, flags=re.ASCII)[:100] or "run"


def _as_spec(spec: Any) -> tuple[RunSpec, bool]:
    """The spec, and whether it asked for its spares (a field given, or a RunSpec whose count
    is not the default): only a default is dropped quietly where spares cannot work."""
    from slurmft.controller.spec import RunSpec, SpecError

    if isinstance(spec, RunSpec):
        return spec, spec.spares != RunSpec.__dataclass_fields__["spares"].default
    if isinstance(spec, str | os.PathLike):
        path = Path(spec)
        loaded = RunSpec.from_toml(path)
        return loaded, spec_file_sets(path, "spares")
    if isinstance(spec, Mapping):
        data = dict(spec)
        data.setdefault("name", default_name(list(data.get("script") or ())))
        return RunSpec.from_dict(data), "spares" in data
    raise SpecError(
        f"a run spec is a RunSpec, a mapping of its fields or a TOML file's path, "
        f"not {type(spec).__name__}"
    )


def spec_file_sets(path: Path | None, field: str) -> bool:
    """Whether a spec file names ``field`` (a value it gives, not the default)."""
    import tomllib

    return path is not None and field in tomllib.loads(path.read_text())


def _with_python(spec: RunSpec) -> RunSpec:
    """The job's interpreter: the one given, else the active environment's (a container's:
    `python3` on its PATH)."""
    from slurmft.cli.job_python import CONTAINER_PYTHON, default_python

    if spec.python is not None:
        return spec
    return replace(spec, python=CONTAINER_PYTHON if spec.in_container else default_python())


def _checked_torch(spec: RunSpec, note: Note) -> str | None:
    """The job's torch version, from its interpreter (None where it cannot be run here: the
    login host's own torch, if any, stands in)."""
    from slurmft.cli.job_python import check_python
    from slurmft.core import torch_support

    assert spec.python is not None
    checked = check_python(spec.python, spec.agent_wrapper, pyxis=spec.container_image is not None)
    if checked.warning:
        note(checked.warning)
    return checked.torch if checked.torch is not None else torch_support.installed_version()


def spares_for_this_torch(
    spec: RunSpec, *, explicit: bool, version: str | None, note: Note
) -> RunSpec:
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
        note(f"note: running without spares: {why}")
        spec = replace(spec, spares=0)
    for warning in torch_support.warnings_for(version, spec.spares):
        note(warning)
    return spec


def _note_plugin_options(spec: RunSpec, note: Note) -> None:
    """Options Slurm 22.05 does not have are passed on: say so (a typo reaches sbatch)."""
    from slurmft.slurm import passthrough

    notes = [*passthrough.parse("sbatch", spec.sbatch_args).notes,
             *passthrough.parse("srun", spec.srun_args).notes]  # fmt: skip
    for text in notes:
        note(f"note: {text}")


def _note_ignored_environment(note: Note) -> None:
    """sbatch's input variables are not passed on: a resubmission could not repeat them."""
    ignored = sorted(name for name in os.environ if name.startswith(("SBATCH_", "SLURM_"))
                     and name != "SLURM_CONF")  # fmt: skip
    if ignored:
        note(
            f"note: not passed to sbatch (a resubmission could not repeat them): "
            f"{', '.join(ignored)}; use the flags, --sbatch-arg or --env"
        )


def _checked(spec: Any, spares_explicit: bool | None, note: Note) -> RunSpec:
    """The spec as it will run: parsed, its interpreter found and checked, spares fitted to
    its torch; what the caller should know said through ``note``."""
    run_spec, asked = _as_spec(spec)
    run_spec = _with_python(run_spec)
    explicit = asked if spares_explicit is None else spares_explicit
    run_spec = spares_for_this_torch(
        run_spec, explicit=explicit, version=_checked_torch(run_spec, note), note=note
    )
    _note_ignored_environment(note)
    _note_plugin_options(run_spec, note)
    return run_spec


def submit(
    spec: RunSpec | Mapping[str, Any] | str | os.PathLike[str],
    *,
    config: Config | None = None,
    spares_explicit: bool | None = None,
    on_note: Note | None = None,
) -> Run:
    """Submit a training run; the `Run` to follow it.

    ``spec``: a `RunSpec`, a mapping of its fields (as in a spec file; ``name`` defaults to the
    script's), or a TOML spec file's path. Checked as `slurmft submit` checks it: a bad field
    raises SpecError naming it, and nothing is submitted. ``spares_explicit``: whether the spare
    count was asked for (refused where this torch cannot use spares) or is a default (dropped,
    with a note); by default, whether the spec names it. Notes go to ``on_note``, else are
    warned as SubmitNote. ``config``: the settings (default: the config files and
    environment, as the CLI reads them).
    """
    from slurmft.agent.state_dir import check_state_dir
    from slurmft.config import load_config
    from slurmft.controller.resubmit import submission_record
    from slurmft.errors import SlurmftError

    config = config or load_config()
    run_spec = _checked(spec, spares_explicit, on_note or _warn)
    # Refused before the run exists: a checkpoint directory whose .slurmft someone else made.
    check_state_dir(run_spec.ckpt_dir)
    socket_path = _socket(config)
    created = _ask(socket_path, "create_run", spec=run_spec.to_dict())
    run_id = created["run_id"]
    try:
        job_id, request = _submit_job(config, run_spec, created)
    except Exception as exc:  # whatever failed, the run must not stay pending for ever
        known = isinstance(exc, SlurmftError | OSError)
        why = str(exc) if known else f"{type(exc).__name__}: {exc}"
        _ask(socket_path, "fail_run", run_id=run_id, reason=f"submission failed: {why}")
        raise
    # The daemon keeps what was sent, to send it again (as this user) if Slurm cannot requeue it.
    submission = submission_record(request, workdir=os.getcwd(), path=os.environ.get("PATH", ""))
    _ask(socket_path, "attach_job", run_id=run_id, job_id=job_id, submission=submission)
    return Run(run_id, job_id=job_id, spec=run_spec, config=config)


def plan_submission(
    spec: RunSpec | Mapping[str, Any] | str | os.PathLike[str],
    *,
    config: Config | None = None,
    spares_explicit: bool | None = None,
    on_note: Note | None = None,
) -> SubmissionPlan:
    """What `submit` would send for ``spec`` (checked the same way), submitting nothing: the
    batch script, sbatch's argv and the agent step's srun argv (`slurmft submit --dry-run`)."""
    from slurmft.agent.batch import srun_argv
    from slurmft.agent.state_dir import TOKEN_FILE
    from slurmft.config import load_config
    from slurmft.slurm.commands import submit_argv

    config = config or load_config()
    run_spec = _checked(spec, spares_explicit, on_note or _warn)
    created = {
        "run_id": DRY_RUN_ID,
        "controller_url": "<the daemon's agents_url>",
        "exclude": [],
    }
    token_file = str(Path(run_spec.ckpt_dir) / TOKEN_DIR / TOKEN_FILE)
    batch, request = batch_plan(config, run_spec, created, token_file)
    count = run_spec.nodes + run_spec.spares
    agent = batch.agent_argv("<batch host>", outcome_dir="<ckpt>/.slurmft/steps/<job>.<launch>")
    placeholders = [f"node{i}" for i in range(count)]
    srun = [
        f"--nodelist=<the job's {count} nodes>" if word.startswith("--nodelist=") else word
        for word in srun_argv(placeholders, agent, batch.step_options())
    ]
    return SubmissionPlan(request.script, submit_argv(request), srun)


def write_token(ckpt_dir: str, token: str) -> Path:
    """The run's token, readable by its owner only, where every node of the job can read it
    (in a private ``<ckpt>/.slurmft``, never through a link: slurmft.agent.state_dir)."""
    from slurmft.agent import state_dir

    return state_dir.write_token(ckpt_dir, token)


def batch_plan(
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

    token_file = write_token(spec.ckpt_dir, created["token"])
    _, request = batch_plan(config, spec, created, str(token_file))
    slurm = config.settings.slurm
    # The environment a resubmission has too: nothing of this shell leaks into the job.
    owner = pwd.getpwuid(os.getuid())
    env = submit_environment(owner, os.environ.get("PATH", ""), slurm.conf or None)
    client = CliSlurmClient(SubprocessRunner(env, inherit=False), timeout_s=slurm.command_timeout_s)
    return client.submit(request), request
