"""`verify`: an undamaged checkpoint passes and gets a manifest; each kind of damage gets a clear error."""

import hashlib
import json
import os

import pytest

from moestream.checkpoint.index import build_index
from moestream.checkpoint.manifest import MANIFEST_FILE, IntegrityError, load_manifest
from moestream.checkpoint.shards import INDEX_FILE
from moestream.checkpoint.verify import published_sha256, verify
from moestream.errors import CheckpointError
from tests.checkpoint.damage import copy_checkpoint, overwrite, scramble_experts


@pytest.fixture
def model_dir(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("qwen2_moe", num_layers=2, max_shard_bytes=300_000)
    return copy_checkpoint(source, tmp_path / "model")


def _shards(path):
    return sorted(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())


def test_an_undamaged_checkpoint_passes_and_gets_a_manifest(model_dir):
    seen, totals = [], []
    report = verify(model_dir, seen.append, on_start=totals.append)
    shards = sorted(set(_shards(model_dir)))
    assert report.manifest_written and report.num_shards == len(shards) > 1
    assert totals == [sum(seen)] == [report.bytes_checked] == [sum((model_dir / s).stat().st_size for s in shards)]
    assert report.num_published == 0 and report.bytes_per_s > 0
    manifest = load_manifest(build_index(model_dir))
    assert len(manifest.digests) == report.num_experts
    again = verify(model_dir)
    assert not again.manifest_written


def test_damaged_expert_bytes_fail_against_the_manifest_and_nothing_is_rewritten(model_dir):
    verify(model_dir)
    written = (model_dir / MANIFEST_FILE).read_bytes()
    (info, _), *_ = scramble_experts(model_dir, layer=1)
    with pytest.raises(IntegrityError) as error:
        verify(model_dir)
    message = str(error.value)
    assert f"shard {info.file.name}" in message and f"tensor {info.name}" in message and "MoE layer 1 expert 0" in message
    assert (model_dir / MANIFEST_FILE).read_bytes() == written
    assert verify(model_dir, rewrite=True).manifest_written


def test_damaged_header_and_truncated_shard_get_clear_errors(model_dir):
    shard = model_dir / _shards(model_dir)[0]
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with pytest.raises(CheckpointError, match=f"truncated shard {shard}"):
        verify(model_dir)
    os.truncate(shard, size)
    overwrite(shard, 8, b"\xff" * 16)
    with pytest.raises(CheckpointError, match=f"corrupt header in {shard}"):
        verify(model_dir)


def _hf_snapshot(model_dir, root):
    """The checkpoint laid out as a Hugging Face cache: snapshot links to blobs named by sha256."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        name = hashlib.sha256(file.read_bytes()).hexdigest() if file.suffix == ".safetensors" else file.name
        (blobs / name).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(blobs / name)
    return snapshot


def test_shards_of_a_hugging_face_snapshot_are_checked_against_their_sha256(model_dir, tmp_path):
    snapshot = _hf_snapshot(model_dir, tmp_path / "hub")
    shard = snapshot / _shards(model_dir)[-1]
    assert published_sha256(shard) == shard.resolve().name and published_sha256(model_dir / shard.name) is None
    report = verify(snapshot)
    assert report.num_published == report.num_shards
    assert json.loads((snapshot / MANIFEST_FILE).read_text())["shards"][shard.name]["sha256"] == shard.resolve().name
    overwrite(shard.resolve(), shard.stat().st_size - 10, b"\x01\x02\x03")
    with pytest.raises(IntegrityError, match=f"damaged shard {shard}: sha256"):
        verify(snapshot, rewrite=True)
