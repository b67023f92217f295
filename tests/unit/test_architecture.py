"""The architecture as a test: the import contracts in pyproject.toml hold on the real tree, and
each one fails, by name, on a copy of the tree with one forbidden import added.

A second check is what a node pays at start: the agent, the batch step, the wire protocol and the
policy load no SQLAlchemy or Alembic, and `slurmft --version` loads neither those nor the agent:
of slurmft, only the command modules and what their options name.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# One forbidden import per contract: (contract id, module file, the line added to it).
VIOLATIONS = [
    ("core-stdlib-only", "slurmft/core/kinds.py", "import sqlalchemy"),
    ("daemon-no-torch", "slurmft/controller/act.py", "import torch"),
    ("store-no-policy", "slurmft/db/records.py", "import slurmft.controller.decide"),
    ("slurm-no-store", "slurmft/slurm/parse.py", "import slurmft.db.models"),
    ("train-no-slurm-store-daemon", "slurmft/train/report.py", "import slurmft.controller.rpc"),
    ("agent-no-store-controller", "slurmft/agent/reporter.py", "import slurmft.db"),
    ("wire-and-policy-no-store", "slurmft/controller/decide.py", "import sqlalchemy.orm"),
    ("sim-no-policy-of-its-own", "slurmft/sim/ladder.py", "import slurmft.controller.detect"),
    ("policy-knows-no-sim", "slurmft/controller/decide.py", "import slurmft.sim.engine"),
]


def contracts() -> dict[str, str]:
    """Contract id -> name, as pyproject.toml declares them."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract["name"] for contract in config["contracts"]}


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    # The copy is found first on sys.path, before the installed (editable) checkout.
    env = {"PYTHONPATH": str(tree), "PATH": str(LINT_IMPORTS.parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(tree / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def copy_of_the_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "slurmft", tree / "slurmft", ignore=skip)
    shutil.copy(REPO / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_every_contract_has_one_violation_here() -> None:
    assert sorted(contracts()) == sorted(contract for contract, _, _ in VIOLATIONS)


def test_the_real_tree_keeps_every_contract(tmp_path: Path) -> None:
    done = lint_imports(copy_of_the_tree(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Contracts: {len(contracts())} kept, 0 broken." in done.stdout


@pytest.mark.parametrize(("contract", "module", "line"), VIOLATIONS, ids=[v[0] for v in VIOLATIONS])
def test_one_forbidden_import_breaks_its_contract(
    tmp_path: Path, contract: str, module: str, line: str
) -> None:
    tree = copy_of_the_tree(tmp_path)
    target = tree / module
    target.write_text(target.read_text() + f"\n{line}  # the violation under test\n")
    done = lint_imports(tree)
    assert done.returncode != 0
    name = contracts()[contract]
    broken = [text for text in done.stdout.split("\n\n") if "BROKEN" in text]
    assert any(" ".join(name.split()) in " ".join(text.split()) for text in broken), done.stdout


def modules_loaded_by(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def top_level(modules: set[str], *names: str) -> set[str]:
    return {m for m in modules if m.split(".")[0] in names}


def test_the_node_side_and_the_policy_load_no_store() -> None:
    loaded = modules_loaded_by(
        "import slurmft.agent.agent, slurmft.agent.batch_step, slurmft.protocol, "
        "slurmft.controller.decide"
    )
    assert "slurmft.agent.agent" in loaded  # the probe imported what it names
    assert top_level(loaded, "sqlalchemy", "alembic", "torch") == set()
    assert {m for m in loaded if m.startswith("slurmft.db")} == set()


def test_a_warm_workers_client_loads_only_the_standard_library() -> None:
    """torchrun starts one per worker in place of the script (slurmft.agent.warm_start): what it
    imports is the whole cost of a warm start besides the fork."""
    loaded = modules_loaded_by("import slurmft.agent.warm_start")
    ours = {m for m in loaded if m.split(".")[0] == "slurmft"}
    assert ours == {"slurmft", "slurmft.agent", "slurmft.agent.warm_start"}
    assert top_level(loaded, "torch", "msgspec", "pydantic", "numpy", "typer") == set()


def test_slurmft_version_loads_neither_the_store_nor_the_agent() -> None:
    loaded = modules_loaded_by(
        "import sys\nfrom slurmft.cli import main\nsys.argv = ['slurmft', '--version']\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass"
    )
    assert "slurmft.cli.app" in loaded
    assert top_level(loaded, "sqlalchemy", "alembic", "torch", "msgspec") == set()
    # Building the app takes the command modules and what their options name: the settings
    # (defaults, the root's state; the restart cap's from the vocabulary), the history views
    # (help) and the report's column default.
    # Everything a command runs (the agent, the batch script, the daemon's socket client, the
    # Slurm client, the store) is imported by the command.
    beyond_the_cli = {
        m for m in loaded if m.startswith("slurmft.") and not m.startswith("slurmft.cli")
    }
    assert beyond_the_cli == {
        "slurmft._lazy",
        "slurmft.config",
        "slurmft.core",
        "slurmft.core.defaults",
        "slurmft.db",
        "slurmft.db.history",
        "slurmft.errors",
        "slurmft.report",
        "slurmft.version",
    }


def test_importing_slurmft_or_its_training_library_loads_no_socket_client() -> None:
    """The Python API (`slurmft.submit`, `slurmft.Run`) is loaded on first use: a training
    worker that imports slurmft.train never loads the daemon's socket client or the store."""
    for statement in ("import slurmft", "import slurmft.train"):
        loaded = modules_loaded_by(statement)
        assert {"slurmft.api", "slurmft.controller.rpc", "slurmft.db"} & loaded == set()
        assert top_level(loaded, "sqlalchemy", "alembic", "typer") == set()
    loaded = modules_loaded_by("import slurmft\nslurmft.submit")
    assert {"slurmft.api", "slurmft.api.submission", "slurmft.controller.rpc"} <= loaded
    assert top_level(loaded, "sqlalchemy", "alembic", "torch") == set()


def test_the_daemon_and_the_command_line_load_no_training_framework() -> None:
    """The daemon, its command line and the Python API run where no torch, Lightning or
    transformers is installed (the login node), and must not load them where they are."""
    loaded = modules_loaded_by(
        "import slurmft.controller.daemon, slurmft.cli.app, slurmft.api, slurmft.sim.engine"
    )
    assert "slurmft.controller.daemon" in loaded  # the probe imported what it names
    frameworks = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers")
    assert top_level(loaded, *frameworks, "accelerate") == set()
