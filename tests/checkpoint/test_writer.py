"""The tensor-at-a-time safetensors writer: files safetensors reads back value for value, every tensor
aligned, shards cut between units of tensors, and never more than a few tensors produced ahead."""

import json
import struct
import threading

import pytest
import torch
from safetensors import safe_open

from moestream.checkpoint import writer
from moestream.checkpoint.writer import TensorPlan


def values(tensor: TensorPlan) -> torch.Tensor:
    count = 1
    for size in tensor.shape:
        count *= size
    return (torch.arange(count, dtype=torch.float64) + len(tensor.name)).reshape(tensor.shape).to(tensor.dtype)


TENSORS = [TensorPlan("layers.10.w", (3, 5), torch.bfloat16), TensorPlan("layers.2.w", (7,), torch.float32),
           TensorPlan("layers.2.b", (1,), torch.bfloat16), TensorPlan("embed", (4, 3), torch.float32),
           TensorPlan("flag", (3,), torch.bool)]


@pytest.mark.parametrize("workers", [1, 3])
def test_safetensors_reads_back_every_value_aligned(tmp_path, workers):
    path = tmp_path / "model.safetensors"
    written = []
    writer.write_shard(path, TENSORS, values, workers, written.append)
    assert sum(written) == sum(t.nbytes for t in TENSORS) and len(written) == len(TENSORS)
    with safe_open(path, "pt") as handle:
        assert set(handle.keys()) == {t.name for t in TENSORS} and handle.metadata() == {"format": "pt"}
        for tensor in TENSORS:
            assert torch.equal(handle.get_tensor(tensor.name), values(tensor))
    size = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8:8 + size])
    assert (8 + size) % 8 == 0
    for tensor in TENSORS:
        assert header[tensor.name]["data_offsets"][0] % tensor.dtype.itemsize == 0


def test_a_fill_of_the_wrong_shape_or_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="layers.2.w: filled with torch.float64"):
        writer.write_shard(tmp_path / "x.safetensors", TENSORS[1:2], lambda t: torch.zeros(t.shape, dtype=torch.float64), 1)


def test_shards_keep_each_unit_whole_in_order_up_to_the_limit():
    tensors = [TensorPlan(f"layers.{i}.w", (10,), torch.float32) for i in (10, 2, 1)]  # 40 bytes each
    big = TensorPlan("big", (100,), torch.float32)
    shards = writer.plan_shards([[tensors[0]], [big], tensors[1:]], 90)
    assert [[t.name for t in shard] for shard in shards] == [["layers.10.w"], ["big"], ["layers.2.w", "layers.1.w"]]
    assert len(writer.plan_shards([tensors, [big]], None)) == 1
    assert writer.shard_names(1) == ["model.safetensors"]
    assert writer.shard_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = writer.index(shards, writer.shard_names(len(shards)))
    assert index["metadata"]["total_size"] == 520 and index["weight_map"]["layers.1.w"].startswith("model-00003")


def test_at_most_two_tensors_per_worker_are_produced_ahead_of_the_file(tmp_path):
    """A tensor is alive from its fill until the writer has written it: memory holds a few, never a shard."""
    tensors = [TensorPlan(f"t.{i:02d}", (8,), torch.float32) for i in range(40)]
    order, lock, alive, most, written = writer.file_order(tensors), threading.Lock(), set(), [0], []

    def fill(tensor):
        with lock:
            alive.add(tensor.name)
            most[0] = max(most[0], len(alive))
        return values(tensor)

    def on_written(nbytes):
        with lock:
            alive.discard(order[len(written)].name)
            written.append(nbytes)

    writer.write_shard(tmp_path / "x.safetensors", tensors, fill, 2, on_written)
    assert len(written) == 40 and 2 <= most[0] <= 2 * 2 + 1
