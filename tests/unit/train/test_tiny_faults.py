"""The example script's fault injection: which start of the workers a fault is due in."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torch


def test_under_slurmfts_launcher_the_attempt_is_the_rendezvous_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slurmft.train.examples.tiny import fault_due

    # A rank moved to a node whose workers were stopped for a change of members: torch's count
    # there is still 0, but this is the second start of the workers (round 1).
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURMFT_RDZV_ROUND", "1")
    assert not fault_due("8@0", 8, rank=1, fault_rank=1)
    assert fault_due("8@1", 8, rank=1, fault_rank=1)
    assert fault_due("8@*", 8, rank=1, fault_rank=1)
    assert not fault_due("8@1", 7, rank=1, fault_rank=1) and not fault_due("8@1", 8, 0, 1)
    # A plain torchrun: torch's own count.
    monkeypatch.delenv("SLURMFT_RDZV_ROUND")
    assert fault_due("8@0", 8, rank=1, fault_rank=1)
