"""Per-expert digests: pieces follow the disk tensors, a check names the damaged shard, tensor, expert."""

import json

import pytest
import torch

from moestream.checkpoint.index import build_index
from moestream.checkpoint.manifest import MANIFEST_FILE, IntegrityError, Manifest, digest, expert_pieces, load_manifest
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


def test_damage_to_an_expert_s_first_piece_is_found_and_named(model_dir):
    checkpoint = build_index(model_dir)
    manifest = _manifest(checkpoint)
    key = ExpertKey(0, 2)
    slot = _slot(checkpoint, key)
    first = manifest.pieces[key][0]
    assert first.slot_offset == 0 and len(manifest.pieces[key]) > 1
    slot[first.slot_offset + 1] ^= 0x01
    with pytest.raises(IntegrityError) as error:
        manifest.check(key, slot)
    message = str(error.value)
    assert f"shard {first.shard}" in message and f"tensor {first.tensor}" in message
    assert "MoE layer 0 expert 2" in message


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


def test_a_check_fed_chunk_by_chunk_fails_on_the_chunk_that_completes_a_damaged_piece(model_dir):
    checkpoint = build_index(model_dir)
    manifest = _manifest(checkpoint)
    key = ExpertKey(1, 0)
    slot = _slot(checkpoint, key)
    bounds = [0, 1, 100, 101, 5000, slot.numel() // 2, slot.numel()]  # chunks across piece boundaries
    check = manifest.begin(key)
    for lo, hi in zip(bounds, bounds[1:]):
        assert not check.done
        check.update(slot[lo:hi])
    assert check.done
    damaged = manifest.pieces[key][1]
    slot[damaged.slot_offset + damaged.nbytes - 1] ^= 0x10  # the piece's last byte
    check = manifest.begin(key)
    check.update(slot[: damaged.slot_offset + damaged.nbytes - 1])  # not complete yet: nothing to say
    with pytest.raises(IntegrityError, match=f"tensor {damaged.tensor}, MoE layer 1 expert 0"):
        check.update(slot[damaged.slot_offset + damaged.nbytes - 1 :])


def test_bytes_outside_host_memory_are_refused_never_read_back(model_dir):
    """A device slot is never read back to be hashed (a meta tensor stands for device memory here)."""
    checkpoint = build_index(model_dir)
    manifest = _manifest(checkpoint)
    key = ExpertKey(1, 3)
    elsewhere = torch.empty(checkpoint.topology.expert_bytes, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="checked in host memory"):
        manifest.check(key, elsewhere)
    with pytest.raises(ValueError, match="checked in host memory"):
        manifest.begin(key).update(elsewhere)
