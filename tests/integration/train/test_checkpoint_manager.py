"""CheckpointManager and the telemetry all-reduce in one process (a world of one, gloo)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch


def state(value: float) -> dict:
    import torch

    return {"model": {"w": torch.full((4, 4), value)}}


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_save_publish_retention_and_fallback(world_of_one: None, tmp_path: Path) -> None:
    from slurmft.train import CheckpointInvalid, CheckpointManager

    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    assert manager.check_shared_directory() == []
    assert manager.latest_verified() is None
    for step in (1, 2, 3):
        manager.save(step, state(float(step)), {"global_step": step})
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step-000000002", "step-000000003"]

    corrupt(tmp_path / "ckpt" / "step-000000003" / "__0_0.distcp")
    found = manager.latest_verified()
    assert found is not None and found.step == 2
    assert found.skipped == ("step-000000003: rank 0: __0_0.distcp: checksum mismatch",)
    assert (tmp_path / "ckpt" / "invalid-step-000000003").is_dir()
    loaded = state(0.0)
    rng = manager.load(found, loaded)
    assert float(loaded["model"]["w"][0, 0]) == 2.0
    assert set(rng) == {"python", "numpy", "torch_cpu", "torch_cuda"}

    (tmp_path / "ckpt" / "step-000000002" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointInvalid, match="refusing to start from scratch"):
        manager.latest_verified()


def test_a_save_interrupted_before_publishing_is_never_a_candidate(
    world_of_one: None, tmp_path: Path
) -> None:
    from slurmft.train import CheckpointManager

    def crash(step: int) -> None:
        raise KeyboardInterrupt  # stands in for a kill between the shards and the manifest

    CheckpointManager(tmp_path / "ckpt").save(1, state(1.0), {"global_step": 1})
    manager = CheckpointManager(tmp_path / "ckpt", on_shards_written=crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, state(2.0), {"global_step": 2})
    assert (tmp_path / "ckpt" / ".staging-step-000000002" / "__0_0.distcp").is_file()
    found = manager.latest_verified()
    assert found is not None and found.step == 1
    assert manager.check_shared_directory() == [".staging-step-000000002"]


def test_telemetry_rides_on_the_gradient_all_reduce(world_of_one: None) -> None:
    import torch

    from slurmft.train import StepTimer, all_reduce_with_telemetry, exchange_telemetry

    timer = StepTimer()
    timer.start_step(1)
    with timer.compute():
        time.sleep(0.05)
    with timer.wait():
        grads, exchange = all_reduce_with_telemetry(torch.ones(5), timer.current_compute_s(), True)
    timing = timer.end_step()
    assert timing is not None and timing.compute_s >= 0.05 and timing.wait_s < timing.compute_s
    assert grads.tolist() == [1.0] * 5
    assert exchange.compute_s == pytest.approx([timing.compute_s], rel=1e-6)
    assert exchange.save_requested
    gathered = exchange_telemetry(0.25, False)
    assert (gathered.compute_s, gathered.save_requested) == ([0.25], False)


def test_a_directory_rank_0_cannot_create_fails_every_rank_with_the_reason(
    world_of_one: None, tmp_path: Path
) -> None:
    from slurmft.train import CheckpointManager, CheckpointSaveFailed

    (tmp_path / "a-file").write_text("")
    manager = CheckpointManager(tmp_path / "a-file" / "ckpt")
    with pytest.raises(CheckpointSaveFailed, match="preparing the checkpoint directory"):
        manager.check_shared_directory()
