"""Test helpers: an expert's slot read straight from its disk segments, and a disk tensor by name."""

from pathlib import Path

import torch
from safetensors import safe_open

from moestream.checkpoint.index import CheckpointIndex
from moestream.topology import ExpertKey


def read_slot(checkpoint: CheckpointIndex, key: ExpertKey) -> torch.Tensor:
    """The expert's slot bytes (uint8 [expert_bytes]): its segments, in order, as the store copies them."""
    chunks = []
    for segment in checkpoint.experts.locations[key].segments:
        with open(segment.file, "rb") as handle:
            handle.seek(segment.offset)
            chunks.append(handle.read(segment.nbytes))
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def disk_tensor(path: Path, name: str) -> torch.Tensor:
    """The tensor `name` as safetensors reads it from whichever shard of `path` holds it."""
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as shard:
            if name in shard.keys():
                return shard.get_tensor(name)
    raise KeyError(name)
