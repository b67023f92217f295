"""docs/testing.md's serial-group table names exactly the tests marked `serial`: a test that
joins the group without a row (or leaves it and keeps one) makes the table wrong about which
time bounds the suite protects, and why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
TESTING_MD = REPO / "docs" / "testing.md"
BACKTICKED = re.compile(r"`([^`]+)`")


def _is_serial_mark(node: ast.expr, aliases: set[str]) -> bool:
    """`pytest.mark.serial`, or a module-level name bound to it."""
    if isinstance(node, ast.Attribute):
        return node.attr == "serial" and ast.unparse(node.value) == "pytest.mark"
    return isinstance(node, ast.Name) and node.id in aliases


def _serial_marks(source: str) -> tuple[bool, set[str]]:
    """Whether a test module is serial as a whole (its `pytestmark`), and which of its test
    functions are marked one by one. A serial mark anywhere else (on a class, in
    `pytest.param(marks=...)`) is not mapped to tests here, so it fails the parse instead of
    passing unseen."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    whole = False
    placed: set[ast.expr] = set()  # the mark nodes accounted for
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]  # `pytestmark: list[Mark] = [...]`
        else:
            continue
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        value = statement.value
        marks = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
        if "pytestmark" in names:
            serial = [m for m in marks if _is_serial_mark(m, aliases)]
            whole = whole or bool(serial)
            placed |= set(serial)
        elif _is_serial_mark(value, aliases):
            aliases |= names
            placed.add(value)
    functions: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            mark = decorator.func if isinstance(decorator, ast.Call) else decorator
            if _is_serial_mark(mark, aliases):
                functions.add(node.name)
                placed.add(mark)
    unplaced = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute | ast.Name)
        and isinstance(node.ctx, ast.Load)
        and _is_serial_mark(node, aliases)
        and node not in placed
    ]
    if unplaced:
        raise ValueError(f"a serial mark this check does not map to tests, at lines {unplaced}")
    return whole, functions


def _marked() -> set[str]:
    """Each serial module (`unit/x/test_y.py`) and each serial test (`…::test_z`)."""
    found: set[str] = set()
    for path in sorted(TESTS.rglob("test_*.py")):
        whole, functions = _serial_marks(path.read_text(encoding="utf-8"))
        name = path.relative_to(TESTS).as_posix()
        if whole:
            found.add(name)
        found |= {f"{name}::{function}" for function in functions}
    return found


def _table_rows(markdown: str) -> list[str]:
    """The first cells of the table under "## The serial group"."""
    section = markdown.split("## The serial group", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [row.split(" | ", 1)[0] for row in rows[2:]]  # past the header and its rule


def _documented(markdown: str) -> set[str]:
    """A row names a module (all its tests), a test by node id, or a module followed by the
    names of its serial tests."""
    found: set[str] = set()
    for cell in _table_rows(markdown):
        path, *tests = BACKTICKED.findall(cell)
        found |= {f"{path}::{test}" for test in tests} if tests else {path}
    return found


def test_the_serial_table_names_exactly_the_tests_marked_serial() -> None:
    marked, documented = _marked(), _documented(TESTING_MD.read_text(encoding="utf-8"))
    assert marked, "no test is marked serial: the parse of the markers is broken"
    unlisted, stale = sorted(marked - documented), sorted(documented - marked)
    assert not unlisted, f"marked serial, no row in docs/testing.md: {unlisted}"
    assert not stale, f"a row in docs/testing.md, not marked serial: {stale}"


def test_markers_are_read_at_module_level_by_alias_and_per_test() -> None:
    source = (
        "import pytest\n"
        "pytestmark = [pytest.mark.slurm, pytest.mark.serial]\n"
        "SLOW = pytest.mark.serial\n"
        "@SLOW\n"
        "def test_a(): ...\n"
        "@pytest.mark.serial\n"
        "@pytest.mark.parametrize('x', [1])\n"
        "def test_b(x): ...\n"
        "@pytest.mark.slurm\n"
        "def test_c(): ...\n"
    )
    assert _serial_marks(source) == (True, {"test_a", "test_b"})
    assert _serial_marks("import pytest\npytestmark = pytest.mark.slurm\n") == (False, set())
    annotated = "import pytest\npytestmark: list[object] = [pytest.mark.serial]\n"
    assert _serial_marks(annotated) == (True, set())


def test_a_serial_mark_on_a_class_or_a_param_is_refused_not_missed() -> None:
    on_a_class = "import pytest\n@pytest.mark.serial\nclass TestX:\n    def test_a(self): ...\n"
    in_a_param = (
        "import pytest\n"
        "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.serial)])\n"
        "def test_a(x): ...\n"
    )
    for source in (on_a_class, in_a_param):
        with pytest.raises(ValueError, match="does not map"):
            _serial_marks(source)


def test_a_row_names_a_module_a_node_id_or_a_module_and_its_tests() -> None:
    markdown = (
        "## The serial group\n\n| test | why |\n| --- | --- |\n"
        "| `a/test_x.py` (both) | one |\n"
        "| `a/test_y.py::test_q` | two |\n"
        "| `a/test_z.py` (two: `test_r`, `test_s`) | three |\n\n"
        "Not a row.\n\n## The budget\n\n| `b/test_w.py` | elsewhere |\n"
    )
    assert _documented(markdown) == {
        "a/test_x.py", "a/test_y.py::test_q", "a/test_z.py::test_r", "a/test_z.py::test_s",
    }  # fmt: skip
