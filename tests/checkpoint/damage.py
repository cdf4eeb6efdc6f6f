"""Ways to damage a copy of a checkpoint on disk, as failing disks and bad downloads do."""

import shutil
from pathlib import Path

import numpy as np

from moestream.checkpoint.index import build_index
from moestream.checkpoint.manifest import MANIFEST_FILE

DAMAGE_BYTES = 4096


def copy_checkpoint(source: Path, target: Path) -> Path:
    """A copy as a download would be: make-model's integrity manifest left out (verify writes one)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(MANIFEST_FILE))
    return target


def expert_tensors(path: Path, layer: int = 0) -> list:
    """TensorInfo of the first disk tensor of every routed expert of one MoE layer (slices of a fused one)."""
    checkpoint = build_index(path)
    infos = []
    for key, location in sorted(checkpoint.experts.locations.items()):
        if key.layer == layer:
            segment = location.segments[0]
            owner = next(t for t in checkpoint.tensors.values()
                         if t.file == segment.file and t.offset <= segment.offset < t.offset + t.nbytes)
            infos.append((owner, segment))
    return infos


def overwrite(file: Path, offset: int, data: bytes) -> None:
    """Writes data over the file's bytes at offset; the file keeps its size."""
    with open(file, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def scramble_experts(path: Path, layer: int = 0, seed: int = 0) -> list:
    """4 KiB of random bytes in the middle of the first tensor of every expert of a layer; returns them."""
    rng = np.random.default_rng(seed)
    damaged = expert_tensors(path, layer)
    for _, segment in damaged:
        size = min(DAMAGE_BYTES, segment.nbytes)
        start = segment.offset + (segment.nbytes - size) // 2
        overwrite(segment.file, start, rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return damaged


def nan_in_experts(path: Path, layer: int = 0) -> None:
    """A float32 NaN as the first value of the first tensor of every expert of a layer."""
    for info, segment in expert_tensors(path, layer):
        assert info.dtype.is_floating_point and info.dtype.itemsize == 4
        overwrite(segment.file, segment.offset, np.array([np.nan], dtype=np.float32).tobytes())
