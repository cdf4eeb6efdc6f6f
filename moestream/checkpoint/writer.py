"""Writes safetensors shards a tensor at a time, so a checkpoint larger than memory can be written: the
same format as safetensors' own writer (which takes a whole shard), from a header planned ahead, a few
workers producing the next tensors as the file is written. Tensors go widest element first (then by name),
as safetensors orders them, so each starts aligned. Knows tensors' names, shapes and dtypes, not what fills
them or which model they belong to."""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from moestream.checkpoint.shards import DTYPES, SINGLE_FILE

HEADER_ALIGN = 8
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a checkpoint, as it will lie on disk."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Fill = Callable[[TensorPlan], torch.Tensor]  # the tensor's values: contiguous, of its shape and dtype


def plan_shards(units: list[list[TensorPlan]], max_shard_bytes: int | None) -> list[list[TensorPlan]]:
    """Units of tensors (each kept in one shard), in order, cut into shards of at most max_shard_bytes (None: one
    shard); a unit larger than the limit gets a shard of its own."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for unit in units:
        unit_bytes = sum(tensor.nbytes for tensor in unit)
        if max_shard_bytes is not None and shards[-1] and size + unit_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += unit_bytes
    return shards


def shard_names(count: int) -> list[str]:
    """File names transformers gives shards: one model.safetensors, else model-0000i-of-0000n."""
    return [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def file_order(shard: list[TensorPlan]) -> list[TensorPlan]:
    return sorted(shard, key=lambda t: (-t.dtype.itemsize, t.name))


def header(shard: list[TensorPlan]) -> bytes:
    """The shard's header: length, then JSON padded with spaces so that the data starts 8-byte aligned."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for tensor in file_order(shard):
        entries[tensor.name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, shard: list[TensorPlan], fill: Fill, workers: int,
                on_bytes: Callable[[int], None] = lambda n: None) -> None:
    """Writes the shard to `path`, each tensor produced by `fill` (in `workers` threads) when its turn nears."""
    with open(path, "wb") as handle:
        handle.write(header(shard))
        for tensor, values in _produced(file_order(shard), fill, workers):
            _check(tensor, values)
            handle.write(memoryview(values.view(torch.uint8).reshape(-1).numpy()))
            on_bytes(tensor.nbytes)


def _produced(tensors: list[TensorPlan], fill: Fill, workers: int) -> Iterator[tuple[TensorPlan, torch.Tensor]]:
    """(tensor, values) in order, at most 2 x workers of them produced ahead of the writer."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        queue = iter(tensors)
        pending = deque((tensor, pool.submit(fill, tensor)) for tensor in itertools.islice(queue, 2 * workers))
        while pending:
            tensor, future = pending.popleft()
            pending.extend((following, pool.submit(fill, following)) for following in itertools.islice(queue, 1))
            yield tensor, future.result()


def _check(tensor: TensorPlan, values: torch.Tensor) -> None:
    if tuple(values.shape) != tensor.shape or values.dtype != tensor.dtype or not values.is_contiguous():
        raise ValueError(f"{tensor.name}: filled with {values.dtype} {tuple(values.shape)}, "
                         f"planned {tensor.dtype} {tensor.shape} (contiguous)")


def index(shards: list[list[TensorPlan]], names: list[str]) -> dict:
    """The safetensors index transformers writes beside several shards."""
    weight_map = {tensor.name: name for shard, name in zip(shards, names) for tensor in shard}
    total = sum(tensor.nbytes for shard in shards for tensor in shard)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
