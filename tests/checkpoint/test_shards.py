"""Safetensors headers are parsed without the library, checked against the file, and errors name the file."""

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.checkpoint.index import build_index
from moestream.checkpoint.shards import INDEX_FILE, read_header, read_tensors
from moestream.errors import CheckpointError

SMALL_SHARD_BYTES = 200_000


def write_header(file, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_offsets_point_at_each_tensors_bytes(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=generator), "b": torch.randn(7, generator=generator).bfloat16(),
               "c": torch.arange(4, dtype=torch.int64)}
    save_file(tensors, tmp_path / "x.safetensors")
    infos = read_header(tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    with safe_open(tmp_path / "x.safetensors", "pt") as handle:
        for name, info in infos.items():
            expected = handle.get_tensor(name)
            raw = bytearray(data[info.offset : info.offset + info.nbytes])
            assert (info.dtype, info.shape) == (expected.dtype, tuple(expected.shape))
            assert torch.equal(torch.frombuffer(raw, dtype=torch.uint8).view(info.dtype).view(info.shape), expected)


def test_sharded_checkpoint_maps_each_tensor_to_its_shard(tiny_checkpoint):
    path = tiny_checkpoint("mixtral", max_shard_bytes=SMALL_SHARD_BYTES)
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    tensors = read_tensors(path)
    assert set(tensors) == set(weight_map)
    assert all(tensors[name].file.name == shard for name, shard in weight_map.items())
    assert len(set(weight_map.values())) > 1


@pytest.fixture
def sharded_copy(tiny_checkpoint, tmp_path):
    destination = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint("mixtral", max_shard_bytes=SMALL_SHARD_BYTES), destination)
    return destination


def test_index_naming_a_missing_shard(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} named in .* is missing"):
        build_index(sharded_copy)


def test_index_naming_the_wrong_shard(sharded_copy):
    index = json.loads((sharded_copy / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (sharded_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is not in shard {shards[1]}"):
        build_index(sharded_copy)


def test_corrupt_shard_index(sharded_copy):
    (sharded_copy / INDEX_FILE).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="corrupt shard index"):
        build_index(sharded_copy)


def test_truncated_shard(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"truncated shard .*{shard.name}"):
        build_index(sharded_copy)


def test_no_weights_at_all(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint("mixtral") / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        build_index(tmp_path)


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\x01\x02", "too short for a header"),
        (struct.pack("<Q", 10**12) + b"{}", "header length 1000000000000 does not fit"),
        (struct.pack("<Q", 6) + b"{bad!}", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_corrupt_header(tmp_path, content, problem):
    (tmp_path / "x.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=f"corrupt header in .*x.safetensors: .*{problem}"):
        read_header(tmp_path / "x.safetensors")


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"dtype": "F32", "shape": [2]}, "bad entry for tensor 't'"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "spans 4 bytes, its shape \\(2,\\) needs 8"),
        ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}, "unsupported dtype 'Q4'"),
    ],
)
def test_bad_tensor_entry(tmp_path, entry, problem):
    write_header(tmp_path / "x.safetensors", {"t": entry}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=problem):
        read_header(tmp_path / "x.safetensors")


def test_data_beyond_the_end_of_the_file(tmp_path):
    write_header(tmp_path / "x.safetensors", {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match="truncated shard .*x.safetensors: its header places tensors up to byte"):
        read_header(tmp_path / "x.safetensors")
