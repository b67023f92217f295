"""A node's in-memory snapshots as files (slurmft.train.snapshot.SnapshotFolder) and how often
to take one (snapshot_every): the parts without collectives."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.train.snapshot import SnapshotFolder, snapshot_every


def test_the_newest_snapshot_that_checks_out_is_found_and_older_ones_are_pruned(
    tmp_path: Path,
) -> None:
    folder = SnapshotFolder(tmp_path / "shm")
    for step in (3, 4, 5):
        folder.write(step, f"state {step}".encode(), {"resume": {"global_step": step}})
    assert folder.steps() == [5, 4]  # two kept
    step, manifest, payload = folder.newest_valid(newer_than=0)  # type: ignore[misc]
    assert (step, payload, manifest["resume"]) == (5, b"state 5", {"global_step": 5})
    assert folder.newest_valid(newer_than=5) is None  # not newer than the durable checkpoint


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-1] + b"X"), "checksum mismatch"),
        (lambda p: p.write_bytes(p.read_bytes()[:-2]), "bytes, not as written"),
        (lambda p: p.unlink(), "unreadable"),
    ],
)
def test_a_damaged_newest_snapshot_falls_back_to_the_one_before_and_says_why(
    tmp_path: Path, damage: object, reason: str
) -> None:
    folder = SnapshotFolder(tmp_path)
    folder.write(7, b"seven", {})
    folder.write(8, b"eight", {})
    damage(tmp_path / "step-000000008.pt")  # type: ignore[operator]
    found = folder.newest_valid(newer_than=0)
    assert isinstance(found, tuple) and found[0] == 7
    damage(tmp_path / "step-000000007.pt")  # type: ignore[operator]
    why = folder.newest_valid(newer_than=0)
    assert isinstance(why, str) and reason in why and "step 8" in why


@pytest.mark.parametrize(
    ("snapshot_s", "step_s", "write_s", "every"),
    [
        (0.0015, 0.1, 0.0, 1),
        (0.01, 0.1, 0.0, 7),  # 10 ms every 7 steps of 100 ms: 1.4 %
        (0.3, 0.1, 0.0, 200),
        (0.0, 0.1, 0.0, 1),
        (0.1, 0.0, 0.0, 1),
        (0.01, 0.1, 0.45, 9),  # the write takes 4.5 steps: half of 9
        (0.0, 0.1, 0.005, 1),  # a write well within a step
        (0.3, 0.1, 0.45, 200),
    ],
)
def test_a_snapshot_costs_half_the_budget_and_writes_never_overlap(
    snapshot_s: float, step_s: float, write_s: float, every: int
) -> None:
    assert snapshot_every(snapshot_s, step_s, write_s=write_s) == every
