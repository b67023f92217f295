"""The agent's preflight over slurmft.gpu: only drain-class conditions keep a node out."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.agent.probe import NodeGpuProbe
from slurmft.gpu import GpuProbe, InjectionSource


def _probe(spec: str) -> NodeGpuProbe:
    return NodeGpuProbe(GpuProbe([InjectionSource(spec)]))


def test_xid_79_makes_the_node_unfit_with_a_readable_reason() -> None:
    report = _probe("xid=79,gpu=3").probe()
    assert not report.fit
    ((fault),) = report.faults
    assert (fault.xid, fault.gpu_index) == (79, 3)
    assert fault.message.startswith("slurmft: Xid 79") and fault.message.endswith("(GPU 3)")


@pytest.mark.parametrize("spec", ["xid=13,gpu=0", "kind=clock_slowdown,gpu=0,reasons=0x40", ""])
def test_restart_class_and_record_only_faults_do_not_keep_the_node_out(spec: str) -> None:
    assert _probe(spec).probe().fit


def test_a_probe_with_nothing_to_report_leaves_the_node_fit() -> None:
    report = NodeGpuProbe(GpuProbe([])).probe()
    assert report.fit


def test_faults_during_the_run_are_streamed_once_with_their_action(tmp_path: Path) -> None:
    faults = tmp_path / "inject"
    faults.write_text("")
    probe = NodeGpuProbe(GpuProbe([InjectionSource(str(faults))]))
    assert probe.new_faults() == []
    faults.write_text("xid=79,gpu=3\nxid=13,gpu=1\n")
    streamed = probe.new_faults()
    assert sorted((f.xid, f.gpu_index, f.action) for f in streamed) == [
        (13, 1, "restart_app"),
        (79, 3, "drain"),
    ]
    assert all(not f.message.startswith("slurmft:") for f in streamed)
    assert probe.new_faults() == []  # each once
