"""Per-expert digests: pieces follow the disk tensors, a check names the damaged shard, tensor, expert."""

import json

import pytest
import torch

from moestream.checkpoint.index import build_index
from moestream.checkpoint.manifest import (MANIFEST_FILE, IntegrityError, Manifest, digest, expert_pieces,
                                           load_manifest)
from moestream.errors import CheckpointError
from moestream.topology import ExpertKey
from tests.checkpoint.damage import copy_checkpoint


@pytest.fixture
def model_dir(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("qwen2_moe", num_layers=2, max_shard_bytes=300_000)
    return copy_checkpoint(source, tmp_path / "model")


def _slot(checkpoint, key) -> torch.Tensor:
    """The expert's slot bytes [expert_bytes] read with plain file reads."""
    data = b""
    for segment in checkpoint.experts.locations[key].segments:
        with open(segment.file, "rb") as handle:
            handle.seek(segment.offset)
            data += handle.read(segment.nbytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _manifest(checkpoint) -> Manifest:
    pieces = expert_pieces(checkpoint)
    digests = {key: tuple(digest(_slot(checkpoint, key).numpy()[p.slot_offset: p.slot_offset + p.nbytes])
                          for p in found) for key, found in pieces.items()}
    shards = {f.name: {"bytes": f.stat().st_size, "sha256": None} for f in {t.file for t in checkpoint.tensors.values()}}
    return Manifest(checkpoint.path, pieces, digests, shards)


def test_pieces_tile_each_slot_with_named_tensors(model_dir):
    checkpoint = build_index(model_dir)
    pieces = expert_pieces(checkpoint)
    assert set(pieces) == set(checkpoint.experts.locations)
    for key, found in pieces.items():
        assert [p.slot_offset for p in found] == [0, *[p.slot_offset + p.nbytes for p in found][:-1]]
        assert sum(p.nbytes for p in found) == checkpoint.topology.expert_bytes
        for piece in found:
            info = checkpoint.tensors[piece.tensor]
            assert info.file.name == piece.shard
            assert info.offset <= piece.file_offset and piece.file_offset + piece.nbytes <= info.offset + info.nbytes


def test_a_check_passes_intact_bytes_and_names_a_damaged_piece(model_dir):
    checkpoint = build_index(model_dir)
    manifest = _manifest(checkpoint)
    key = ExpertKey(1, 3)
    slot = _slot(checkpoint, key)
    manifest.check_batch([key], [slot])
    damaged = manifest.pieces[key][-1]
    slot[damaged.slot_offset + 5] ^= 0xFF
    with pytest.raises(IntegrityError) as error:
        manifest.check(key, slot)
    message = str(error.value)
    assert f"shard {damaged.shard}" in message and f"tensor {damaged.tensor}" in message
    assert "MoE layer 1 expert 3" in message and "\n" not in message


def test_a_saved_manifest_loads_back_and_a_stale_one_is_refused(model_dir):
    checkpoint = build_index(model_dir)
    assert load_manifest(checkpoint) is None
    manifest = _manifest(checkpoint)
    manifest.save()
    loaded = load_manifest(checkpoint)
    assert loaded.digests == manifest.digests and loaded.pieces == manifest.pieces
    shard = next(iter(manifest.shards))
    with open(model_dir / shard, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(CheckpointError, match=f"stale: shard {shard}"):
        load_manifest(checkpoint)


def test_an_unreadable_manifest_is_a_user_error(model_dir):
    checkpoint = build_index(model_dir)
    (model_dir / MANIFEST_FILE).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        load_manifest(checkpoint)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_slot_in_device_memory_is_checked_too(model_dir):
    checkpoint = build_index(model_dir)
    manifest = _manifest(checkpoint)
    key = ExpertKey(1, 3)
    slot = _slot(checkpoint, key).cuda()
    manifest.check(key, slot)
    slot[manifest.pieces[key][0].slot_offset] ^= 0xFF
    with pytest.raises(IntegrityError):
        manifest.check(key, slot)
