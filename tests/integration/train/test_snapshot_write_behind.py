"""In-memory snapshots are written behind the training loop (slurmft.train.snapshot): the loop
waits for a copy only, so what is written is the state at the snapshot's step even though the
loop changed it meanwhile; K follows the measured wait; a record that outgrows its slot or a
write that fails costs that snapshot, never the training. One process, gloo."""

from __future__ import annotations

import io
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.torch
# serial: K is picked from measured step and write times, which load from other tests stretches
# (a loaded run gave K 32 against the bound of 30).
K_FROM_MEASURED_TIMES = pytest.mark.serial


def written(folder: Path, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from slurmft.train.snapshot import SnapshotFolder

    manifest, payload = SnapshotFolder(folder).read(step)
    return manifest, torch.load(io.BytesIO(payload), weights_only=True)


def test_the_written_snapshot_is_the_state_at_its_step_not_the_state_after_it(
    tmp_path: Path, world_of_one: None
) -> None:
    import torch

    from slurmft.train.snapshot import MemorySnapshots

    weights = torch.zeros(256, 256)
    snapshots = MemorySnapshots(str(tmp_path / "shm"), every=1)
    for step in (1, 2, 3):
        weights.fill_(step)
        resume = {"step": step}
        snapshots.after_step(step, lambda: {"model": {"w": weights}}, lambda: resume)  # noqa: B023
        weights.fill_(-1.0)  # the next step changes the state while the write goes on
    snapshots.flush()
    for step in (2, 3):  # two kept
        manifest, state = written(tmp_path / "shm", step)
        assert bool((state["model"]["w"] == step).all())
        assert manifest["resume"] == {"step": step}
        assert len(manifest["rng"]) == 1 and set(manifest["rng"][0]) >= {"python", "torch_cpu"}
    assert snapshots.last_error == ""


def test_host_buffers_are_reused_while_shapes_stay() -> None:
    import torch

    from slurmft.train.snapshot import HostCopy

    host = HostCopy()
    first = host.copy({"w": torch.ones(3), "groups": [{"lr": 0.1}]})()
    again = host.copy({"w": torch.full((3,), 2.0), "groups": [{"lr": 0.2}]})()
    assert again["w"] is first["w"] and again["w"].tolist() == [2.0, 2.0, 2.0]
    assert again["groups"] == [{"lr": 0.2}]
    grown = host.copy({"w": torch.ones(4)})()
    assert grown["w"] is not first["w"] and grown["w"].shape == (4,)


@K_FROM_MEASURED_TIMES
def test_k_follows_the_measured_wait(tmp_path: Path, world_of_one: None) -> None:
    import torch

    from slurmft.train.snapshot import MemorySnapshots

    def slow_state() -> dict[str, Any]:
        time.sleep(0.05)  # a copy that blocks the loop for 50 ms
        return {"w": torch.ones(2)}

    snapshots = MemorySnapshots(str(tmp_path / "shm"))
    assert snapshots.every == 1
    step = 0
    while step < 6:
        step += 1
        time.sleep(0.01)  # 10 ms steps: 50 ms is 5 steps' time, far over 3 %
        snapshots.after_step(step, slow_state, dict)
    # The first snapshots' wait is shared at the next one: K is then well past 100.
    assert snapshots.every > 100, snapshots.every
    snapshots.flush()


def test_a_record_that_outgrows_its_slot_costs_that_snapshot_only(
    tmp_path: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from slurmft.train import snapshot

    snapshots = snapshot.MemorySnapshots(str(tmp_path / "shm"), every=1)
    snapshots.after_step(1, lambda: {"w": torch.ones(2)}, dict)
    snapshots.flush()
    real = snapshot.capture_rng_state
    monkeypatch.setattr(snapshot, "capture_rng_state", lambda: {**real(), "pad": "x" * 100_000})
    snapshots.after_step(2, lambda: {"w": torch.ones(2)}, dict)
    snapshots.flush()
    assert "outgrew its slot" in snapshots.last_error
    assert snapshot.SnapshotFolder(tmp_path / "shm").steps() == [1]
    monkeypatch.setattr(snapshot, "capture_rng_state", real)
    snapshots.after_step(3, lambda: {"w": torch.ones(2)}, dict)
    snapshots.flush()
    assert snapshots.last_error == ""
    assert snapshot.SnapshotFolder(tmp_path / "shm").steps() == [3, 1]


def test_a_failed_write_is_reported_and_training_goes_on(
    tmp_path: Path, world_of_one: None
) -> None:
    import torch

    from slurmft.train.snapshot import MemorySnapshots

    blocked = tmp_path / "shm"
    blocked.write_text("a file where the folder should be")
    snapshots = MemorySnapshots(str(blocked), every=1)
    assert snapshots.after_step(1, lambda: {"w": torch.ones(2)}, dict)
    snapshots.flush()
    assert "snapshot of step 1 not written" in snapshots.last_error
    assert snapshots.after_step(2, lambda: {"w": torch.ones(2)}, dict)


def test_a_full_tmpfs_while_the_state_is_serialized_costs_that_snapshot_only(
    tmp_path: Path, world_of_one: None
) -> None:
    """torch.save into a file that cannot grow (here /dev/full: ENOSPC, as a full tmpfs) raises
    a RuntimeError, not an OSError: the snapshot is reported lost, its partial file goes (in
    tmpfs it holds RAM), and training and the next snapshot go on."""
    import torch

    from slurmft.train import snapshot

    folder = tmp_path / "shm"
    snapshots = snapshot.MemorySnapshots(str(folder), every=1)
    snapshots.after_step(1, lambda: {"w": torch.ones(1000)}, dict)
    snapshots.flush()
    partial = folder / ".step-000000002.pt.partial"
    partial.symlink_to("/dev/full")
    assert snapshots.after_step(2, lambda: {"w": torch.ones(1000)}, dict)
    snapshots.flush()
    assert "snapshot of step 2 not written" in snapshots.last_error
    assert not partial.is_symlink() and not partial.exists()
    assert snapshot.SnapshotFolder(folder).steps() == [1]
    snapshots.after_step(3, lambda: {"w": torch.ones(1000)}, dict)
    snapshots.flush()
    assert snapshots.last_error == "" and snapshot.SnapshotFolder(folder).steps() == [3, 1]


def test_fsdp_state_is_refused_before_any_collective(tmp_path: Path, world_of_one: None) -> None:
    """FSDP2 on the CPU: its state dict holds DTensors, each rank's shard on its node alone, so
    a lost node's snapshot would go with it. Every rank refuses at the first snapshot, before
    the gather (one refusing alone would leave the others waiting in it)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from slurmft.train.snapshot import MemorySnapshots, ShardedState

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()

    def state() -> dict[str, Any]:
        weights, optim = get_state_dict(model, optimizer)
        return {"model": weights, "optim": optim}

    snapshots = MemorySnapshots(str(tmp_path / "shm"), every=1)
    with pytest.raises(ShardedState, match=r"/model/0\.weight is a DTensor"):
        snapshots.after_step(1, state, dict)
    assert snapshots._pending_gather is None and snapshots._pending_write is None
    assert not (tmp_path / "shm").exists()


@K_FROM_MEASURED_TIMES
def test_k_counts_what_the_write_beside_the_steps_cost_them(
    tmp_path: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the background write shares the cores with the steps: the loop waits only for
    the copy, but the steps beside the write take longer, and K must pay for that too."""
    import torch

    from slurmft.train import snapshot

    real_write = snapshot.SnapshotFolder.write_with

    def slow_write(self: snapshot.SnapshotFolder, *args: Any) -> None:
        time.sleep(0.1)
        real_write(self, *args)

    monkeypatch.setattr(snapshot.SnapshotFolder, "write_with", slow_write)
    snapshots = snapshot.MemorySnapshots(str(tmp_path / "shm"), every=20)  # K held: no waits
    for step in range(1, 61):
        pending = snapshots._pending_write
        # 10 ms a step alone, 30 ms while a write goes on beside it.
        time.sleep(0.03 if pending is not None and not pending.done() else 0.01)
        snapshots.after_step(step, lambda: {"w": torch.ones(2)}, dict)
    snapshots.flush()
    # The snapshot of step 40 (the first, of step 20, pays for the buffers and is left out):
    # the loop waited a few milliseconds, the four or so steps beside its write lost 20 ms each.
    assert snapshots.last_cost_s < 0.05
    (cost_s,) = snapshots.recent_costs
    assert 0.05 <= cost_s < 0.3, snapshots.recent_costs
    assert snapshot.snapshot_every(cost_s, statistics.median(snapshots.step_times)) > 100


@K_FROM_MEASURED_TIMES
def test_k_keeps_the_writes_apart_and_is_not_inflated_by_their_overlap(
    tmp_path: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K starts at 1, so the first snapshots wait for each other's writes. That wait is K's
    doing, not the snapshot's cost: K follows the write's duration instead (200 ms, half of 40
    steps of 10 ms), and not the hundreds of steps a 200 ms cost would have made it."""
    import torch

    from slurmft.train import snapshot

    real_write = snapshot.SnapshotFolder.write_with

    def slow_write(self: snapshot.SnapshotFolder, *args: Any) -> None:
        time.sleep(0.2)
        real_write(self, *args)

    monkeypatch.setattr(snapshot.SnapshotFolder, "write_with", slow_write)
    snapshots = snapshot.MemorySnapshots(str(tmp_path / "shm"))
    for step in range(1, 120):
        time.sleep(0.01)
        snapshots.after_step(step, lambda: {"w": torch.ones(2)}, dict)
    snapshots.flush()
    assert 40 <= snapshots.every <= 60, snapshots.every
    assert max(snapshots.recent_costs) < 0.05, snapshots.recent_costs


@K_FROM_MEASURED_TIMES
def test_a_slow_step_that_is_not_the_writes_doing_does_not_set_k(
    tmp_path: Path, world_of_one: None
) -> None:
    """A step that writes a durable checkpoint (here every 7th, 100 ms against 20 ms) now and
    then lands beside a snapshot's write. K follows the snapshots' typical cost (a 3 ms wait:
    about 10 steps of 20 ms at half of 3 %; the copy and the gather add 1-4 ms on a slower
    machine, K 15-20), not that step: taken from the largest of the last costs, one such step
    sent K to hundreds; counted beyond the write's duration, a few in the mean tripled it."""
    import torch

    from slurmft.train.snapshot import MemorySnapshots

    def state() -> dict[str, Any]:
        time.sleep(0.003)
        return {"w": torch.ones(2)}

    snapshots = MemorySnapshots(str(tmp_path / "shm"))
    ks = []
    for step in range(1, 200):
        time.sleep(0.1 if step % 7 == 0 else 0.02)
        if snapshots.after_step(step, state, dict):
            ks.append(snapshots.every)
    snapshots.flush()
    # Under load a 3 ms wait takes longer: room up to 3 and 6 times the quiet K, far below
    # the hundreds a durable step set it to.
    assert 8 <= snapshots.every <= 30, ks
    assert max(ks[5:]) <= 60, ks


def test_a_write_is_charged_no_more_than_it_lasted(tmp_path: Path, world_of_one: None) -> None:
    """The step after each snapshot is slow for reasons of its own (300 ms against 10 ms, a
    durable checkpoint), beside a write of a few milliseconds: what the steps beside a write
    lost is counted up to the write's duration, so that step is not the snapshot's cost."""
    import torch

    from slurmft.train.snapshot import MemorySnapshots

    snapshots = MemorySnapshots(str(tmp_path / "shm"), every=4)  # K held: the same pattern
    write_durations = []
    for step in range(1, 22):
        time.sleep(0.3 if step % 4 == 1 and step > 1 else 0.01)
        if step % 4 == 0 and step >= 12:  # the previous snapshot's write, done: its duration
            write_durations.append(snapshots._write_s)
        snapshots.after_step(step, lambda: {"w": torch.ones(2)}, dict)
    snapshots.flush()
    # The costs of the snapshots of steps 8, 12 and 16 (settled at the next; the first left
    # out), each its wait plus what the steps beside its write lost.
    losses = [c - w for c, w in zip(snapshots.recent_costs, snapshots.recent_waits, strict=True)]
    assert len(losses) == len(write_durations) == 3, snapshots.recent_costs
    assert all(loss <= d + 1e-9 for loss, d in zip(losses, write_durations, strict=True)), (
        losses,
        write_durations,
    )
