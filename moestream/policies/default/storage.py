"""Reading a trained `default` model's weights.safetensors as numpy arrays, without torch (the directory's
format and its checks are moestream.policies.trained's).

The token memory (11 MiB for DeepSeek-V2-Lite's vocabulary) loads as a copy-on-write map of the file:
a run reads two rows a token, so only those pages take memory, and they stay reclaimable under a
memory limit. The rest loads into memory (every token reads all of it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MAPPED = ("memory",)  # tensors mapped from the file rather than read
NUMPY_DTYPES = {"U8": np.uint8, "I8": np.int8, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64}


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as weights:  # checks the header
        tensors = {name: weights.get_tensor(name) for name in weights.keys() if name not in MAPPED}
    return tensors | _mapped(path)


def _mapped(path: Path) -> dict[str, np.ndarray]:
    """The MAPPED tensors as copy-on-write maps of the file (safetensors: an 8-byte header size, a JSON
    header of dtype, shape and data_offsets from the end of the header, then the data)."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    mapped = {}
    for name in (n for n in MAPPED if n in header):
        info = header[name]
        begin = info["data_offsets"][0]
        mapped[name] = np.asarray(np.memmap(path, np.dtype(NUMPY_DTYPES[info["dtype"]]), "c", 8 + size + begin,
                                            tuple(info["shape"])))
    return mapped
