"""What a user submits: one run's spec, validated before anything reaches Slurm.

`slurmft submit` builds it from flags or a TOML file; the store keeps it with the run so that a
resubmission (after a time limit or a preemption) builds the very same job.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from slurmft.errors import SlurmftError

_TIME_LIMIT = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,100}$")


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
    nproc_per_node: int = 1
    time_limit: str | None = None  # Slurm's format: minutes, [D-]HH:MM[:SS]
    partition: str | None = None
    save_lead_s: int = 300  # the coordinated save starts this long before the time limit
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        _check(
            bool(_NAME.match(self.name)),
            "name",
            f"{self.name!r}: use letters, digits, '_', '.', '-' (at most 100)",
        )
        _check(self.nodes >= 1, "nodes", f"{self.nodes}: at least 1 training node")
        _check(self.spares >= 0, "spares", f"{self.spares}: 0 or more")
        _check(self.nproc_per_node >= 1, "nproc_per_node", f"{self.nproc_per_node}: at least 1")
        _check(bool(self.script), "script", "missing: `slurmft submit ... -- train.py [args]`")
        _check(
            Path(self.ckpt_dir).is_absolute(),
            "ckpt_dir",
            f"{self.ckpt_dir!r}: an absolute path on a filesystem every node mounts",
        )
        _check(
            self.time_limit is None or bool(_TIME_LIMIT.match(self.time_limit)),
            "time_limit",
            f"{self.time_limit!r}: minutes or [D-]HH:MM[:SS], e.g. 2-00:00:00",
        )
        _check(self.save_lead_s >= 0, "save_lead_s", f"{self.save_lead_s}: 0 or more seconds")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["script"] = list(self.script)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "spec") -> RunSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"{where}: unknown field {unknown[0]!r}; fields: {', '.join(known)}")
        try:
            return cls(**{**data, "script": tuple(data.get("script", ()))})
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
    "str | None": (str, type(None)),
    "tuple[str, ...]": (tuple,),
    "dict[str, str]": (dict,),
}


def _check_type(name: str, value: object, annotation: object) -> None:
    expected = _TYPES[str(annotation)]
    ok = isinstance(value, expected) and not (isinstance(value, bool) and int in expected)
    if ok and isinstance(value, tuple | dict):
        items = value.items() if isinstance(value, dict) else ((v, v) for v in value)
        ok = all(isinstance(k, str) and isinstance(v, str) for k, v in items)
    _check(ok, name, f"{value!r} is not {str(annotation).replace(' | None', ' or nothing')}")


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise SpecError(f"bad {name}: {why}")
