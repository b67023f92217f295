"""What a user submits: one run's spec, validated before anything reaches Slurm.

`slurmft submit` builds it from flags or a TOML file; the store keeps it with the run so that a
resubmission (after a time limit or a preemption) builds the very same job.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

from slurmft.errors import SlurmftError
from slurmft.slurm import passthrough
from slurmft.slurm.api import SlurmBadRequest
from slurmft.slurm.script import (
    check_constraint,
    check_gres,
    check_memory,
    check_slurm_name,
    is_env_name,
)

# Matched with fullmatch, in ASCII: `$` would take a name ending in a newline (it matches before
# a final one), and `\d` would take any script's digits.
_TIME_LIMIT = re.compile(r"(\d+-)?\d+(:\d{2}){0,2}", re.ASCII)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}", re.ASCII)
# Beyond any cluster Slurm runs (the largest have about 10,000 nodes), and what the store and the
# batch step can hold: a larger count is a mistake, refused here rather than by the database.
MAX_NODES = 65_536
MAX_NPROC_PER_NODE = 1_024
MAX_SAVE_LEAD_S = 65_535  # sbatch --signal=...@<seconds> takes at most this


class SpecError(SlurmftError):
    """The run spec is wrong; nothing was submitted. The message names the field and the fix."""

    exit_code = 2


@dataclass(frozen=True)
class RunSpec:
    name: str
    nodes: int
    script: tuple[str, ...]  # what follows torchrun's flags: ("train.py", ...) or ("-m", ...)
    ckpt_dir: str  # shared by every node; progress (and the batch step's budget) lives here
    spares: int = 1
    # A number, or "gpu": the GPUs Slurm gives each node's step. None: "gpu" when GPUs are
    # asked for, else 1 (`workers_per_node`).
    nproc_per_node: int | str | None = None
    time_limit: str | None = None  # Slurm's format: minutes, [D-]HH:MM[:SS]
    partition: str | None = None
    save_lead_s: int = 300  # the coordinated save starts this long before the time limit
    env: dict[str, str] = field(default_factory=dict)
    # Site options: sbatch's, applied to the job, every agent step and every resubmission.
    gpus_per_node: int | None = None
    gres: str | None = None  # e.g. gpu:a100:8 (with gpus_per_node, that wins for the steps)
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mem: str | None = None  # per node, sbatch's --mem (e.g. 500G; 0: all of it)
    exclusive: bool = False
    reservation: str | None = None
    cpus_per_task: int | None = None  # CPUs for each node's agent and its workers
    # A site's own options, as sbatch and srun read them (slurmft.slurm.passthrough).
    sbatch_args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    # The job's environment beyond `env`: shell lines run in the batch script and before every
    # agent on every node (`module load ...`, `source venv/bin/activate`).
    setup: tuple[str, ...] = ()
    # The interpreter the job runs slurmft, torchrun and the workers with (absolute; submit
    # fills in the active venv's or conda env's).
    python: str | None = None
    # Containers for the agent step (agent, torchrun and workers inside; the batch step and the
    # rendezvous store outside): pyxis's srun options, or a command the agent runs under.
    container_image: str | None = None
    container_mounts: str | None = None
    container_workdir: str | None = None
    apptainer: str | None = None  # an image: `apptainer exec --nv --bind <ckpt> IMAGE`
    container_wrapper: str | None = None  # shell words, e.g. `bwrap --unshare-pid ...`

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        _check(
            bool(_NAME.fullmatch(self.name)),
            "name",
            f"{self.name!r}: use letters, digits, '_', '.', '-' (at most 100)",
        )
        _check(
            1 <= self.nodes <= MAX_NODES,
            "nodes",
            f"{_number(self.nodes)}: at least 1 training node, at most {MAX_NODES}",
        )
        _check(
            0 <= self.spares <= MAX_NODES - self.nodes,
            "spares",
            f"{_number(self.spares)}: 0 or more, at most {MAX_NODES} nodes with the training ones",
        )
        nproc = self.nproc_per_node
        _check(
            nproc in (None, "gpu") or (isinstance(nproc, int) and 1 <= nproc <= MAX_NPROC_PER_NODE),
            "nproc_per_node",
            f"{_number(nproc) if isinstance(nproc, int) else repr(nproc)}: gpu, or a number "
            f"from 1 to {MAX_NPROC_PER_NODE}",
        )
        _check(
            nproc != "gpu" or self.asks_for_gpus,
            "nproc_per_node",
            "gpu needs GPUs: add gpus_per_node (--gpus-per-node N) or a gpu gres",
        )
        for name in ("gpus_per_node", "cpus_per_task"):
            count = getattr(self, name)
            if count is not None:
                _check(1 <= count <= MAX_NPROC_PER_NODE, name,
                       f"{_number(count)}: from 1 to {MAX_NPROC_PER_NODE}")  # fmt: skip
        self._check_site_options()
        self._check_environment()
        self._check_containers()
        _check(bool(self.script), "script", "missing: `slurmft submit ... -- train.py [args]`")
        _check(
            Path(self.ckpt_dir).is_absolute(),
            "ckpt_dir",
            f"{self.ckpt_dir!r}: an absolute path on a filesystem every node mounts",
        )
        _check(
            self.time_limit is None or bool(_TIME_LIMIT.fullmatch(self.time_limit)),
            "time_limit",
            f"{self.time_limit!r}: minutes or [D-]HH:MM[:SS], e.g. 2-00:00:00",
        )
        _check(
            0 <= self.save_lead_s <= MAX_SAVE_LEAD_S,
            "save_lead_s",
            f"{_number(self.save_lead_s)}: 0 to {MAX_SAVE_LEAD_S} seconds",
        )

    def _check_site_options(self) -> None:
        checks: dict[str, Callable[[str], str]] = {
            "gres": check_gres,
            "account": partial(check_slurm_name, "account"),
            "qos": partial(check_slurm_name, "QOS"),
            "reservation": partial(check_slurm_name, "reservation"),
            "constraint": check_constraint,
            "mem": check_memory,
        }
        for name, check in checks.items():
            value = getattr(self, name)
            if value is not None:
                try:
                    check(value)
                except SlurmBadRequest as error:
                    raise SpecError(f"bad {name}: {error}") from None

    def _check_environment(self) -> None:
        for name in self.env:
            _check(is_env_name(name), "env",
                   f"{name!r} is not a variable name (letters, digits, '_')")  # fmt: skip
        _check(
            self.python is None
            or Path(self.python).is_absolute()
            or (self.in_container and "/" not in self.python),
            "python",
            f"{self.python!r}: an absolute path to the interpreter on every node (in a "
            "container: its path there, or a name on the image's PATH)",
        )
        for name, words in (("sbatch_args", self.sbatch_args), ("srun_args", self.srun_args)):
            try:
                passthrough.check("sbatch" if name == "sbatch_args" else "srun", words)
            except SlurmBadRequest as error:
                raise SpecError(f"bad {name}: {error}") from None

    def _check_containers(self) -> None:
        kinds = ("container_image", "apptainer", "container_wrapper")
        given = [name for name in kinds if getattr(self, name)]
        _check(len(given) <= 1, given[-1] if given else kinds[0],
               f"one container at a time, not {' and '.join(given)}")  # fmt: skip
        for name in ("container_mounts", "container_workdir"):
            _check(not getattr(self, name) or self.container_image is not None, name,
                   "is for a pyxis container: add container_image (--container-image)")  # fmt: skip
        if self.container_wrapper is not None:
            try:
                words = shlex.split(self.container_wrapper)
            except ValueError as error:
                raise SpecError(f"bad container_wrapper: {error}") from None
            _check(bool(words), "container_wrapper", "empty: a command such as `bwrap ...`")

    @property
    def in_container(self) -> bool:
        return bool(self.container_image or self.apptainer or self.container_wrapper)

    @property
    def agent_wrapper(self) -> tuple[str, ...]:
        """The command the agent runs under on every node (empty: none)."""
        if self.apptainer:
            return ("apptainer", "exec", "--nv", "--bind", self.ckpt_dir, self.apptainer)
        return tuple(shlex.split(self.container_wrapper or ""))

    @property
    def container_options(self) -> tuple[str, ...]:
        """pyxis's options for every agent step's srun."""
        pairs = (("--container-image", self.container_image),
                 ("--container-mounts", self.container_mounts),
                 ("--container-workdir", self.container_workdir))  # fmt: skip
        return tuple(f"{flag}={value}" for flag, value in pairs if value)

    @property
    def asks_for_gpus(self) -> bool:
        return bool(self.gpus_per_node) or (self.gres or "").split(":", 1)[0] == "gpu"

    @property
    def workers_per_node(self) -> int | str:
        """torchrun's --nproc-per-node: a number, or gpu (resolved on each node)."""
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        return "gpu" if self.asks_for_gpus else 1

    @property
    def step_gres(self) -> str:
        """What each agent step asks for on each node (GRES are not given to steps unasked)."""
        return f"gpu:{self.gpus_per_node}" if self.gpus_per_node else self.gres or ""

    def site_options(self) -> dict[str, Any]:
        """The SubmitRequest fields of the job's site options."""
        names = ("gpus_per_node", "gres", "account", "qos", "constraint", "mem", "exclusive",
                 "reservation")  # fmt: skip
        return {name: getattr(self, name) for name in names}

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "spec") -> RunSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"{where}: unknown field {unknown[0]!r}; fields: {', '.join(known)}")
        try:
            words = [f.name for f in fields(cls) if f.type == "tuple[str, ...]"]
            lists = {name: tuple(data[name]) for name in words if isinstance(data.get(name), list)}
            return cls(**{**data, **lists, "script": tuple(data.get("script", ()))})
        except TypeError as exc:  # a missing required field
            raise SpecError(f"{where}: {exc}".replace("RunSpec.__init__() ", "")) from None

    @classmethod
    def from_toml(cls, path: Path) -> RunSpec:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise SpecError(f"spec file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"spec file {path} is not valid TOML: {exc}") from None
        return cls.from_dict(data, where=str(path))


_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "str | None": (str, type(None)),
    "int | None": (int, type(None)),
    "int | str | None": (int, str, type(None)),
    "tuple[str, ...]": (tuple,),
    "dict[str, str]": (dict,),
}


def _check_type(name: str, value: object, annotation: object) -> None:
    expected = _TYPES[str(annotation)]
    ok = isinstance(value, expected) and not (isinstance(value, bool) and int in expected)
    if ok and isinstance(value, tuple | dict):
        items = value.items() if isinstance(value, dict) else ((v, v) for v in value)
        ok = all(isinstance(k, str) and isinstance(v, str) for k, v in items)
    _check(ok, name, f"{_shown(value)} is not {str(annotation).replace(' | None', ' or nothing')}")
    for word in _strings(value):
        _check_text(name, word)


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [str(word) for pair in value.items() for word in pair]
    if isinstance(value, tuple):
        return [str(word) for word in value]
    return []


def _check_text(name: str, word: str) -> None:
    """Every string of a spec goes to the store, to the batch script and to sbatch as UTF-8
    text: a word that is not (bytes a shell passed through from a file name in another
    encoding, as lone surrogates) or that holds a NUL is refused here, before any run exists."""
    try:
        word.encode("utf-8")
    except UnicodeEncodeError:
        shown = word.encode("utf-8", "backslashreplace").decode("ascii", "replace")
        raise SpecError(
            f"bad {name}: '{shown}' is not valid UTF-8 text (rename the file, or pass the "
            f"argument in UTF-8)"
        ) from None
    _check("\x00" not in word, name, f"{word!r} contains a NUL character")


def _number(value: int) -> str:
    """A count as a message shows it: a huge one by its size, not in full (Python refuses to
    print an int of more than 4,300 digits)."""
    return str(value) if abs(value) < 10**20 else f"a number of {value.bit_length()} bits"


def _shown(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return _number(value)
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise SpecError(f"bad {name}: {why}")
