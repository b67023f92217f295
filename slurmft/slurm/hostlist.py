"""Slurm hostlists: `n[1-3,7]` <-> `["n1", "n2", "n3", "n7"]`.

Follows Slurm's own rules: several comma-separated items (`a[1-2],b3`), several bracket groups in
one item (`r[1-2]n[1-2]`, the cartesian product), zero padding taken from the lower bound
(`n[08-10]` -> n08 n09 n10), and a suffix after the number (`n[1-2]-ib`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import groupby

_NAME_NUMBER = re.compile(r"^(.*?)(\d+)(\D*)$")


class HostlistError(ValueError):
    """A hostlist expression that Slurm would not accept either."""


def expand(expression: str) -> list[str]:
    """All host names in a hostlist expression, in order (an empty expression gives none)."""
    names: list[str] = []
    for item in _split_top_level(expression.strip()):
        names.extend(_expand_item(item))
    return names


def compress(names: Iterable[str]) -> str:
    """The shortest hostlist expression Slurm would print for these names (sorted, deduplicated)."""
    unique = set(names)
    for name in unique:
        if not name or any(char in name for char in "[],") or name != name.strip():
            raise HostlistError(f"not a host name: {name!r}")
    keyed = sorted(_sort_key(name) for name in unique)
    parts: list[str] = []
    for (prefix, suffix), group in groupby(keyed, key=lambda item: (item[0], item[1])):
        numbered = [digits for _, _, _, digits in group]
        if numbered == [""]:
            parts.append(prefix + suffix)
            continue
        runs = _runs([digits for digits in numbered if digits])
        if len(runs) == 1 and runs[0][0] == runs[0][1]:
            parts.append(f"{prefix}{runs[0][0]}{suffix}")
        else:
            ranges = ",".join(lo if lo == hi else f"{lo}-{hi}" for lo, hi in runs)
            parts.append(f"{prefix}[{ranges}]{suffix}")
    return ",".join(parts)


def _split_top_level(expression: str) -> list[str]:
    items: list[str] = []
    depth = 0
    current = ""
    for char in expression:
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested brackets in {expression!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in {expression!r}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in {expression!r}")
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    """`r[1-2]n[01-02]` -> the cartesian product, expanded left to right."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    return [head + number + rest for number in _expand_ranges(body) for rest in _expand_item(tail)]


def _expand_ranges(body: str) -> list[str]:
    numbers: list[str] = []
    for part in body.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise HostlistError(f"bad range {part!r} in [{body}]")
        if not hi:
            numbers.append(lo)
            continue
        if int(hi) < int(lo):
            raise HostlistError(f"descending range {part!r} in [{body}]")
        numbers.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return numbers


def _sort_key(name: str) -> tuple[str, str, int, str]:
    match = _NAME_NUMBER.match(name)
    if match is None:
        return (name, "", -1, "")
    prefix, digits, suffix = match.groups()
    return (prefix, suffix, int(digits), digits)


def _runs(sorted_digits: list[str]) -> list[tuple[str, str]]:
    """Consecutive numbers with a consistent padding, as (first, last) digit strings."""
    runs: list[tuple[str, str]] = []
    for digits in sorted_digits:
        if runs:
            first, last = runs[-1]
            if int(digits) == int(last) + 1 and digits == str(int(digits)).zfill(len(first)):
                runs[-1] = (first, digits)
                continue
        runs.append((digits, digits))
    return runs
