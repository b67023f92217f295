"""The installed Slurm version, and the behaviours that depend on it.

Version quirks are explicit and named here, so a branch elsewhere reads
`if version.json_honours_filters:` rather than comparing numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, order=True)
class SlurmVersion:
    major: int
    minor: int
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"

    @property
    def json_honours_filters(self) -> bool:
        """22.05's `squeue --json` / `sinfo --json` ignore -j, -t, -n (measured): they list
        everything. 23.02 and later apply the filters."""
        return self >= SlurmVersion(23, 2)

    @property
    def json_takes_data_parser(self) -> bool:
        """23.11 and later accept `--json=<data_parser>` (e.g. v0.0.40)."""
        return self >= SlurmVersion(23, 11)


def parse_version(text: str) -> SlurmVersion:
    """`slurm-wlm 22.05.8`, `slurm 23.11.4`, `slurm 24.05.0-0rc1` -> SlurmVersion."""
    match = _VERSION.search(text)
    if match is None:
        raise ValueError(f"no Slurm version in {text!r}")
    major, minor, micro = match.groups()
    return SlurmVersion(int(major), int(minor), int(micro or 0))
