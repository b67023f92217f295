"""Docs and source comments point only at files inside the repository, and those files exist:
a user has the repository, nothing beside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("docs", "scripts", "tests", "slurmft", "systemd", "migrations")
# Outside the repository: the parent directory's shared notes, or any path climbing out of it.
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(?:notes|DESIGN|STYLE)\b")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
BACKTICKED = re.compile(r"`([^`\s]+)`")
# A repository path, not the tail of an absolute one (/etc/slurmft/slurmft.toml).
REPO_PATH = re.compile(
    rf"(?<![\w/.-])(?:{'|'.join(TOP_LEVEL)})/[\w./-]+\.(?:md|py|toml|service|sh|json)\b"
)
NOT_A_PATH = ("*", "…", "<", "{", "$", "%")


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _sources() -> list[Path]:
    found = [REPO / "pyproject.toml", *sorted((REPO / "systemd").iterdir())]
    for top in ("slurmft", "tests", "scripts", "migrations"):
        found += [
            p
            for p in sorted((REPO / top).rglob("*"))
            if p.is_file()
            and "__pycache__" not in p.parts
            and p.suffix in {".py", ".md", ".toml", ".sh", ""}
            and "fixtures" not in p.parts  # recorded output, not prose
        ]
    return [p for p in found if p.resolve() != Path(__file__).resolve()]


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def _exists(reference: str, beside: Path) -> bool:
    """A reference resolves next to the file that makes it, or from the repository's top."""
    target = reference.split("#", 1)[0]
    if not target:
        return True
    for base in (beside.parent, REPO):
        candidate = (base / target).resolve()
        if candidate.is_relative_to(REPO) and candidate.exists():
            return True
    return False


def _looks_like_a_repo_file(token: str) -> bool:
    if any(mark in token for mark in NOT_A_PATH) or token.startswith(("/", "~", "http")):
        return False
    return token.endswith(".md") or (token.split("/", 1)[0] in TOP_LEVEL and "/" in token)


@pytest.mark.parametrize("path", [*_docs(), *_sources()], ids=lambda p: str(p.relative_to(REPO)))
def test_nothing_points_outside_the_repository(path: Path) -> None:
    outside = [m.group(0) for m in OUTSIDE.finditer(_text(path))]
    assert not outside, f"{path.relative_to(REPO)} refers outside the repository: {outside}"


@pytest.mark.parametrize("path", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_a_page_names_exists(path: Path) -> None:
    text = _text(path)
    links = [t for t in MD_LINK.findall(text) if "://" not in t and not t.startswith("mailto:")]
    named = [t for t in BACKTICKED.findall(text) if _looks_like_a_repo_file(t)]
    missing = sorted({t for t in [*links, *named] if not _exists(t, path)})
    assert not missing, f"{path.relative_to(REPO)} names files that do not exist: {missing}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_a_source_comment_names_exists(path: Path) -> None:
    named = {m.group(0) for m in REPO_PATH.finditer(_text(path))}
    missing = sorted(
        t for t in named if not any(c in t for c in NOT_A_PATH) and not _exists(t, path)
    )
    assert not missing, f"{path.relative_to(REPO)} names files that do not exist: {missing}"


def test_the_check_sees_a_reference_outside_and_a_missing_file(tmp_path: Path) -> None:
    """The patterns catch what they are for (a check that matches nothing passes anything)."""
    assert OUTSIDE.search("measured in ../shared/notes/torchrun.md")
    assert OUTSIDE.search("see shared/notes/local-slurm.md")
    assert not OUTSIDE.search("--ckpt-dir /shared/ckpt")
    page = tmp_path / "page.md"
    assert not _exists("measured/nothing-here.md", page)
    assert _exists("docs/measured/torchrun.md", page)
    assert _looks_like_a_repo_file("docs/slurm.md") and not _looks_like_a_repo_file("/etc/x.md")
