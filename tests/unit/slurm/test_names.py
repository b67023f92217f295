"""The one rule for node names (slurmft.slurm.names), the job-id rule and the drain reason Slurm
is sent (issue 14, items 3, 4 and 5)."""

from __future__ import annotations

import pytest

from slurmft.slurm import commands
from slurmft.slurm.api import SlurmBadRequest
from slurmft.slurm.names import InvalidNodeName, check_node_name, is_node_name
from slurmft.slurm.script import MAX_REASON_CHARS, TRUNCATED_MARK, check_reason, slurm_reason


@pytest.mark.parametrize("name", ["n1", "node-07", "gpu.rack2_a", "A", "x" * 64])
def test_node_names_slurm_uses_pass(name: str) -> None:
    assert is_node_name(name) and check_node_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "n[1-3]", "n1,n2", "n1 n2", "n1\n", "-n1", ".n1", "n1=x", "x" * 65, "n\x00", None, 7],
)
def test_anything_else_is_refused_with_the_name(name: object) -> None:
    assert not is_node_name(name)
    with pytest.raises(InvalidNodeName, match="not a Slurm node name"):
        check_node_name(name)
    assert issubclass(InvalidNodeName, SlurmBadRequest)


def test_exclude_lists_refuse_an_invalid_name_before_any_argv() -> None:
    with pytest.raises(InvalidNodeName):
        commands.set_excluded_nodes_argv("7", ["n1", "n[2-3]"])


@pytest.mark.parametrize("job_id", ["7", "123_4", "123+1"])
def test_job_ids(job_id: str) -> None:
    assert commands.is_job_id(job_id)


@pytest.mark.parametrize("job_id", ["x", "", "7\n", "7 8", "7,8", "-1", None])
def test_not_job_ids(job_id: object) -> None:
    assert not commands.is_job_id(job_id)
    with pytest.raises(SlurmBadRequest, match="not a Slurm job id"):
        commands.squeue_argv(["14", job_id])  # type: ignore[list-item]


def test_a_short_reason_goes_to_slurm_as_it_is() -> None:
    assert slurm_reason("slurmft: Xid 79 on GPU 3") == "slurmft: Xid 79 on GPU 3"


def test_a_long_or_multiline_reason_is_cut_with_a_marker_and_accepted() -> None:
    sent = slurm_reason("slurmft: " + "x" * 400 + "\nsecond line")
    assert len(sent) == MAX_REASON_CHARS and sent.endswith(TRUNCATED_MARK)
    assert check_reason(sent) == sent
    assert slurm_reason("a\nb\tc") == "a b c"
