"""Safetensors shards of a checkpoint directory, read from their headers only (an 8-byte little-endian
length, then JSON: each tensor's dtype, shape and data_offsets after the header): finds the shards (single
file, or `model.safetensors.index.json`) and validates every header against the file size. Knows nothing
about experts or families."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int


def _read_header_json(file: Path) -> tuple[dict, int, int]:
    """(header dict, data start offset, file size); raises CheckpointError for a bad header."""
    file_size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"corrupt header in {file}: file is {file_size} bytes, too short for a header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise CheckpointError(f"corrupt header in {file}: header length {header_len} does not fit the file "
                                  f"({file_size} bytes)")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"corrupt header in {file}: header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt header in {file}: header is not a JSON object")
    return header, 8 + header_len, file_size


def _tensor_info(file: Path, name: str, entry, data_start: int) -> TensorInfo:
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"corrupt header in {file}: bad entry for tensor {name!r}") from None
    if dtype_name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype_name!r} of tensor {name!r} in {file}")
    dtype = DTYPES[dtype_name]
    nbytes = math.prod(shape) * dtype.itemsize
    if begin < 0 or end - begin != nbytes:
        raise CheckpointError(f"corrupt header in {file}: tensor {name!r} spans {end - begin} bytes, its shape "
                              f"{shape} needs {nbytes}")
    return TensorInfo(name, file, dtype, shape, data_start + begin, nbytes)


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, checked against the file's size."""
    header, data_start, file_size = _read_header_json(file)
    header.pop("__metadata__", None)
    tensors = {name: _tensor_info(file, name, entry, data_start) for name, entry in header.items()}
    data_end = max((t.offset + t.nbytes for t in tensors.values()), default=data_start)
    if data_end > file_size:
        raise CheckpointError(f"truncated shard {file}: its header places tensors up to byte {data_end}, the file "
                              f"has {file_size}")
    return tensors


def shard_files(directory: Path) -> dict[str, Path | None]:
    """Tensor name -> shard file per the index (None if the checkpoint is a single file)."""
    index_path = directory / INDEX_FILE
    if not index_path.exists():
        if not (directory / SINGLE_FILE).exists():
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
        return {}
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {str(name): directory / str(shard) for name, shard in weight_map.items()}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"corrupt shard index {index_path}: expected JSON with a 'weight_map' object") from None


def read_tensors(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in `directory`, from the shard headers."""
    weight_map = shard_files(directory)
    if not weight_map:
        return read_header(directory / SINGLE_FILE)
    tensors: dict[str, TensorInfo] = {}
    for file in sorted(set(weight_map.values())):
        if not file.is_file():
            raise CheckpointError(f"shard {file.name} named in {directory / INDEX_FILE} is missing")
        tensors.update(read_header(file))
    for name, file in weight_map.items():
        if name not in tensors or tensors[name].file != file:
            raise CheckpointError(f"tensor {name!r} is not in shard {file.name} as {INDEX_FILE} says")
    return tensors
