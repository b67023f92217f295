"""Slurm node names: the one rule every name slurmft writes to its denylist, or puts into an
exclude list for sbatch or scontrol, must pass.

A node name goes into argv words (``NodeName=...``), into hostlists (``--exclude=n[1-3]``) and
into ``Key=value`` output that slurmft parses back, so only the characters real node names use
are accepted: letters, digits, ``_ . -``, starting with a letter or digit, at most 64 long.
Hostlist syntax (``[ ] ,``), spaces, ``=`` and control characters are never part of one.
"""

from __future__ import annotations

import re

from slurmft.slurm.api import SlurmBadRequest

MAX_NODE_NAME_CHARS = 64
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")  # 64 characters in all


class InvalidNodeName(SlurmBadRequest):
    """A string that is not a Slurm node name, refused before it reaches the store or Slurm."""


def is_node_name(name: object) -> bool:
    return isinstance(name, str) and _NODE_NAME.fullmatch(name) is not None


def check_node_name(name: object) -> str:
    """``name`` if it is a valid Slurm node name; InvalidNodeName (with the name) otherwise."""
    if not is_node_name(name):
        raise InvalidNodeName(
            f"not a Slurm node name: {name!r} (letters, digits and _ . - only, starting with a "
            f"letter or digit, at most {MAX_NODE_NAME_CHARS} characters)"
        )
    assert isinstance(name, str)
    return name
