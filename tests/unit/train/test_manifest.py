from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmft.train.manifest import (
    MANIFEST_NAME,
    CheckpointInvalid,
    beyond_retention,
    build_manifest,
    checkpoint_name,
    digest_file,
    files_to_verify,
    published_checkpoints,
    read_manifest,
    staging_name,
    verify_files,
    write_json_durably,
)


def make_checkpoint(root: Path, step: int, world: int = 2) -> Path:
    directory = root / checkpoint_name(step)
    directory.mkdir(parents=True)
    files = {}
    for rank in range(world):
        name = f"__{rank}_0.distcp"
        (directory / name).write_bytes(bytes([rank]) * (1000 + rank))
        files[name] = digest_file(directory / name, rank)
    manifest = build_manifest(step, world, {"global_step": step}, files)
    write_json_durably(directory / MANIFEST_NAME, manifest)
    return directory


def test_a_written_checkpoint_verifies(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, 10)
    manifest = read_manifest(directory)
    assert manifest["resume"] == {"global_step": 10}
    assert verify_files(directory, manifest, sorted(manifest["files"])) == []


def test_a_flipped_byte_in_a_shard_is_found(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, 10)
    shard = directory / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[500] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = read_manifest(directory)
    assert verify_files(directory, manifest, ["__0_0.distcp"]) == []
    problems = verify_files(directory, manifest, ["__1_0.distcp"])
    assert problems == ["__1_0.distcp: checksum mismatch"]


def test_a_truncated_or_missing_shard_is_found(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, 10)
    (directory / "__0_0.distcp").write_bytes(b"short")
    (directory / "__1_0.distcp").unlink()
    problems = verify_files(directory, read_manifest(directory), ["__0_0.distcp", "__1_0.distcp"])
    assert problems == ["__0_0.distcp: 5 bytes, expected 1000", "__1_0.distcp: missing"]


def test_an_edited_or_missing_manifest_is_invalid(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, 10)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["resume"]["global_step"] = 11
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointInvalid, match="checksum mismatch"):
        read_manifest(directory)
    (directory / MANIFEST_NAME).write_text('{"format": "slurmft-checkpoint", "vers')
    with pytest.raises(CheckpointInvalid, match="unreadable"):
        read_manifest(directory)
    (directory / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointInvalid, match=r"no manifest\.json"):
        read_manifest(directory)


def test_each_rank_verifies_its_own_files_or_a_fair_share_at_a_new_world_size(
    tmp_path: Path,
) -> None:
    manifest = read_manifest(make_checkpoint(tmp_path, 10, world=3))
    assert files_to_verify(manifest, 1, 3) == ["__1_0.distcp"]
    shares = [files_to_verify(manifest, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(manifest["files"])


def test_staging_directories_are_never_candidates_and_retention_keeps_the_newest(
    tmp_path: Path,
) -> None:
    for step in (5, 10, 15, 20):
        make_checkpoint(tmp_path, step)
    (tmp_path / staging_name(25)).mkdir()
    published = published_checkpoints(tmp_path)
    assert [step for step, _ in published] == [20, 15, 10, 5]
    assert beyond_retention(published, 3) == [tmp_path / checkpoint_name(5)]
