"""Hot spares need the wait-list fix, which knows only some torch releases (torch_support)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from slurmft.agent.agent import AgentSettings, NodeAgent
from slurmft.agent.command import TorchrunSpec
from slurmft.agent.exits import AgentExit
from slurmft.agent.probe import NoGpuProbe
from slurmft.api import submission
from slurmft.controller.spec import RunSpec, SpecError
from slurmft.core import torch_support
from slurmft.core.kinds import EventKind

REPO = Path(__file__).resolve().parents[3]
SPEC = RunSpec(name="r", nodes=2, script=("train.py",), ckpt_dir="/shared/r", spares=1)


def _fitted(explicit: bool, version: str, notes: list[str] | None = None) -> RunSpec:
    note = (notes if notes is not None else []).append
    return submission.spares_for_this_torch(SPEC, explicit=explicit, version=version, note=note)


def test_a_known_torch_keeps_its_spares() -> None:
    assert _fitted(True, "2.13.0+cpu").spares == 1


def test_another_torch_runs_without_the_default_spare() -> None:
    notes: list[str] = []
    assert _fitted(False, "2.4.1", notes).spares == 0
    assert any("running without spares" in note for note in notes)


def test_another_torch_refuses_spares_asked_for() -> None:
    with pytest.raises(SpecError, match=r"spares = 1: .*knows torch 2\.13, not 2\.4\.1"):
        _fitted(True, "2.4.1")


def test_the_gate_reads_the_jobs_interpreter_not_the_login_venvs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The login node's slurmft may have another torch, or none: the version that counts is
    what `--python` imports (job_python.check_python runs it)."""
    monkeypatch.setattr(torch_support, "installed_version", lambda: None)
    checked = submission._checked_torch(replace(SPEC, python=sys.executable), print)
    assert checked == torch_support.metadata.version("torch")


def test_no_torch_where_submit_runs_leaves_the_check_to_the_nodes() -> None:
    assert torch_support.spares_work_with(None)


def test_a_refused_spare_is_no_failure_of_its_node(tmp_path: Path) -> None:
    """Its event is `spare_refused`, a kind the failure views never count (migration 0005's
    FAILURE_KINDS): a refused spare never makes its node a lemon."""
    spec = TorchrunSpec(nodes=1, nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", rdzv_id="r",
                        script=("train.py",), spare_candidate=True)  # fmt: skip
    settings = AgentSettings(spec=spec, node="n2", run_id="r", work_dir=tmp_path / "w",
                             controller_url="http://127.0.0.1:9")  # fmt: skip
    node = NodeAgent(settings, NoGpuProbe())  # type: ignore[arg-type]
    assert node._exit_code(int(AgentExit.SPARE_REFUSED)) is AgentExit.SPARE_REFUSED
    assert node.reporter is not None
    assert [(e.kind, e.fault_class) for e in node.reporter.buffer.events] == [
        (EventKind.SPARE_REFUSED, None)
    ]
    migration = REPO / "migrations" / "versions" / "0005_foreign_evidence.py"
    failure_kinds = migration.read_text().split("FAILURE_KINDS = (", 1)[1].split(")", 1)[0]
    assert EventKind.SPARE_REFUSED.value not in failure_kinds
    assert EventKind.PREFLIGHT_FAILED.value in failure_kinds  # the list the views count
