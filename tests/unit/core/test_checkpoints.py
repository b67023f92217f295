"""Progress for any script, on real folder shapes: each layout counts only once complete."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmft.core.checkpoints import MAX_DEPTH, CheckpointWatch


def _write(path: Path, data: bytes = b"x" * 64, *, mtime_s: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime_s is not None:
        os.utime(path, (mtime_s, mtime_s))
    return path


def _twice(watch: CheckpointWatch) -> str | None:
    """Two polls, as the batch step makes them a few seconds apart."""
    watch.poll()
    found = watch.poll()
    return found.path if found else None


def test_torch_save_files_count_once_their_size_holds_and_never_under_temporary_names(
    tmp_path: Path,
) -> None:
    watch = CheckpointWatch(tmp_path)
    _write(tmp_path / "plain-000005.pt.tmp")  # being written (examples/plain.py's temp name)
    _write(tmp_path / ".plain-000005.pt")
    assert _twice(watch) is None
    _write(tmp_path / "plain-000005.pt", mtime_s=1_000)
    assert watch.poll() is None  # first sight: it may still grow
    found = watch.poll()
    assert found is not None and (found.path, found.layout) == ("plain-000005.pt", "file")
    assert found.label == "file plain-000005.pt (1970-01-01T00:16:40)"


def test_a_file_still_growing_is_not_complete(tmp_path: Path) -> None:
    watch = CheckpointWatch(tmp_path)
    ckpt = _write(tmp_path / "epoch=0-step=10.ckpt", b"a" * 10, mtime_s=2_000)
    watch.poll()
    _write(ckpt, b"a" * 20, mtime_s=2_001)  # Lightning is still writing it
    assert watch.poll() is None
    found = watch.poll()
    assert found is not None and found.layout == "lightning"


def test_hugging_face_checkpoints_count_with_their_trainer_state(tmp_path: Path) -> None:
    watch = CheckpointWatch(tmp_path)
    half = tmp_path / "out" / "checkpoint-500"
    _write(half / "model.safetensors")
    _write(half / "optimizer.pt")  # a half-written folder: never searched inside
    assert _twice(watch) is None
    _write(half / "trainer_state.json", b"{}", mtime_s=3_000)
    found = watch.poll()
    assert found is not None and (found.path, found.layout) == ("out/checkpoint-500", "hf")


def test_dcp_folders_count_with_their_metadata(tmp_path: Path) -> None:
    watch = CheckpointWatch(tmp_path)
    dcp = tmp_path / "dcp-step-40"
    _write(dcp / "__0_0.distcp")
    _write(dcp / "__1_0.distcp")
    assert _twice(watch) is None
    _write(dcp / ".metadata", mtime_s=4_000)
    found = watch.poll()
    assert found is not None and (found.path, found.layout) == ("dcp-step-40", "dcp")


def test_nothing_under_the_runs_own_folder_or_its_state_file_counts(tmp_path: Path) -> None:
    watch = CheckpointWatch(tmp_path)
    _write(tmp_path / ".slurmft" / "steps" / "7.1" / "n1.pt")
    _write(tmp_path / ".slurmft" / "checkpoint-9" / "trainer_state.json")
    _write(tmp_path / "slurmft-batch-state.json")
    assert _twice(watch) is None


def test_a_newer_checkpoint_is_progress_and_a_rollback_is_not(tmp_path: Path) -> None:
    watch = CheckpointWatch(tmp_path)
    _write(tmp_path / "a.pt", mtime_s=5_000)
    _write(tmp_path / "b.pt", mtime_s=6_000)
    assert _twice(watch) == "b.pt"
    (tmp_path / "b.pt").unlink()  # the newest is deleted: a.pt is older, not progress
    assert _twice(watch) == "b.pt"
    _write(tmp_path / "c.pt", mtime_s=7_000)
    assert _twice(watch) == "c.pt"
    _write(tmp_path / "c.pt", b"new" * 30, mtime_s=8_000)  # overwritten in place: newer
    found = watch.poll() and watch.poll()
    assert found is not None and found.ordinal == 8_000 * 10**9


def test_slurmft_train_checkpoints_outrank_files(tmp_path: Path) -> None:
    """The ranks report verified progress: file-based progress is ignored for that run."""
    watch = CheckpointWatch(tmp_path)
    _write(tmp_path / "extra.pt", mtime_s=9_999_999)
    (tmp_path / "step-000000010").mkdir()
    found = watch.poll()
    assert found is not None and (found.layout, found.label) == ("slurmft", "step 10")
    assert _twice(watch) == "step-000000010"


def test_the_scan_follows_no_links_and_stops_at_its_depth(tmp_path: Path) -> None:
    outside = _write(tmp_path / "elsewhere" / "x.pt")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "link.pt").symlink_to(outside)
    (ckpt / "linked-dir").symlink_to(outside.parent)
    deep = ckpt.joinpath(*[f"d{i}" for i in range(MAX_DEPTH)])
    _write(deep / "too-deep.pt")
    assert _twice(CheckpointWatch(ckpt)) is None
    _write(ckpt.joinpath(*[f"d{i}" for i in range(MAX_DEPTH - 1)]) / "deep-enough.pt")
    assert _twice(CheckpointWatch(ckpt)) == "/".join(
        [*[f"d{i}" for i in range(MAX_DEPTH - 1)], "deep-enough.pt"]
    )


@pytest.mark.parametrize("missing", ["absent", "file"])
def test_a_checkpoint_path_that_is_not_a_folder_has_no_checkpoint(
    tmp_path: Path, missing: str
) -> None:
    path = tmp_path / "ckpt"
    if missing == "file":
        _write(path)
    assert _twice(CheckpointWatch(path)) is None
