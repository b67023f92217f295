"""The torch-support registry: what submit warns about, the docs' table, and agreement with the
real gate on the torch this suite runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.core import torch_support
from slurmft.core.torch_support import WAIT_LIST_FIX, patch, release_series, warnings_for

DOCS = Path(__file__).parents[2] / "docs" / "agent.md"


def test_a_tested_version_gets_no_warning_and_an_untested_one_names_each_patch() -> None:
    assert release_series("2.13.0+cpu") == "2.13"
    assert warnings_for("2.13.0+cpu", spares=2) == []
    assert warnings_for(None, spares=2) == []  # no torch where submit runs: the agents check
    lines = warnings_for("2.14.1", spares=1)
    assert lines[0].startswith("warning: torch 2.14.1 is not a version")
    assert "(2.13)" in lines[0]
    assert [line.split(" (")[0].strip() for line in lines[1:]] == [
        p.name for p in torch_support.PATCHES
    ]
    # Without spares the wait-list fix does not matter to the run.
    assert not any(WAIT_LIST_FIX in line for line in warnings_for("2.14.1", spares=0))


def test_the_docs_table_is_generated_from_the_registry() -> None:
    text = DOCS.read_text()
    after_begin = text.split("<!-- torch-support:begin -->\n", 1)[1]
    table = after_begin.split("<!-- torch-support:end -->", 1)[0]
    assert table == torch_support.reference_markdown(), (
        "docs/agent.md is out of date: paste slurmft.core.torch_support.reference_markdown()"
    )


@pytest.mark.torch
def test_the_registry_agrees_with_the_gate_on_this_torch() -> None:
    """The torch the suite runs is one the registry lists exactly when the wait-list fix's own
    gate (the fingerprints of torch's source) accepts it: bumping torch without updating one of
    the two fails here."""
    from slurmft.agent import rdzv_fix

    version = torch_support.installed_version()
    assert version is not None
    listed = release_series(version) in patch(WAIT_LIST_FIX).known
    assert (rdzv_fix.check_internals(rdzv_fix.load_module()) == []) is listed
    with pytest.raises(KeyError):
        patch("no such patch")
