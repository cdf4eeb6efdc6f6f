"""Small safetensors checkpoints with a hand-built expert index (read from the files' headers)."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream.checkpoint.layout import ExpertIndex, ExpertLocation, PartView, Segment
from moestream.topology import ExpertKey, Topology

PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class TinyCheckpoint:
    index: ExpertIndex
    files: list[Path]
    hidden: int
    inter: int

    def tensor_name(self, key: ExpertKey, part: str) -> str:
        return f"model.layers.{key.layer + 1}.mlp.experts.{key.expert}.{part}.weight"

    def expected(self, key: ExpertKey) -> dict[str, torch.Tensor]:
        """The expert's slot parts as safetensors itself loads them."""
        loaded = {}
        for path in self.files:
            loaded.update(load_file(str(path)))
        gate, up, down = (loaded[self.tensor_name(key, part)] for part in PARTS)
        return {"gate_up_proj": torch.cat([gate, up]), "down_proj": down}


def header_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (absolute byte offset, nbytes) of every tensor in a safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: (8 + size + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items()}


def write_checkpoint(root: Path, num_layers=2, num_experts=4, top_k=2, hidden=8, inter=6,
                     dtype=torch.bfloat16, num_files=2, seed=0) -> TinyCheckpoint:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_files)]
    for layer in range(num_layers):
        shard = shards[layer % num_files]
        shard[f"model.layers.{layer + 1}.input_layernorm.weight"] = torch.randn(hidden + 3, generator=gen)
        for expert in range(num_experts):
            for part, shape in shapes.items():
                name = f"model.layers.{layer + 1}.mlp.experts.{expert}.{part}.weight"
                shard[name] = torch.randn(shape, generator=gen).to(dtype)
    files = [root / f"model-{i:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    for path, shard in zip(files, shards):
        save_file(shard, str(path))
    element = torch.empty((), dtype=dtype).element_size()
    layout = (PartView("gate_up_proj", (2 * inter, hidden), dtype, 0),
              PartView("down_proj", (hidden, inter), dtype, 2 * inter * hidden * element))
    topology = Topology(tuple(range(1, num_layers + 1)), num_experts, top_k, 3 * inter * hidden * element)
    ckpt = TinyCheckpoint(ExpertIndex(topology, {}, layout), files, hidden, inter)
    for layer in range(num_layers):
        path = files[layer % num_files]
        offsets = header_offsets(path)
        for expert in range(num_experts):
            key = ExpertKey(layer, expert)
            segments = tuple(Segment(path, *offsets[ckpt.tensor_name(key, part)]) for part in PARTS)
            ckpt.index.locations[key] = ExpertLocation(key, segments)
    return ckpt


@pytest.fixture
def checkpoint(tmp_path) -> TinyCheckpoint:
    return write_checkpoint(tmp_path)


@pytest.fixture
def make_checkpoint(tmp_path):
    def make(**kwargs) -> TinyCheckpoint:
        root = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        root.mkdir()
        return write_checkpoint(root, **kwargs)

    return make
