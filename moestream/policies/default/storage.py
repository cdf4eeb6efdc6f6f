"""Saving and loading a trained `default` model: weights.safetensors (numpy arrays, no torch)
plus predictor.json, in the format of moestream.policies.trained, each file written atomically.

The token memory (11 MiB for DeepSeek-V2-Lite's vocabulary) loads as a copy-on-write map of the file:
a run reads two rows a token, so only those pages take memory, and they stay reclaimable under a
memory limit. The rest loads into memory (every token reads all of it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moestream.atomic import atomic_path, write_json
from moestream.errors import MoestreamError
from moestream.policies.trained import (
    FORMAT_VERSION,
    META_FILE,
    WEIGHTS_FILE,
    PredictorFileError,
    check_topology,
    read_meta,
)
from moestream.predictors.configs import TrainConfig

if TYPE_CHECKING:
    from moestream.policies.trained import TrainablePredictor


def save_directory(predictor: "TrainablePredictor", directory: str | Path) -> Path:
    from safetensors.numpy import save_file

    if not predictor.is_trained:
        raise MoestreamError(f"the {predictor.kind} predictor is not trained yet; fit it before saving")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_path(directory / WEIGHTS_FILE) as path:
        save_file(predictor.tensors(), str(path))
    meta = {"format_version": FORMAT_VERSION, "kind": predictor.kind, "topology": predictor.topology.to_dict(),
            "train": predictor.train_config.to_dict(), "losses": predictor.losses} | predictor.meta()
    write_json(meta, directory / META_FILE)
    return directory


def load_directory(predictor: "TrainablePredictor", directory: str | Path) -> None:
    """Restores a predictor saved by save_directory, after checking its kind and topology."""
    from safetensors import SafetensorError

    directory = Path(directory)
    meta = read_meta(directory)
    if meta.get("kind") != predictor.kind:
        raise PredictorFileError(f"{directory} holds a {meta.get('kind')!r} predictor, not {predictor.kind!r}")
    check_topology(meta.get("topology"), predictor.topology, directory)
    try:
        tensors = _load(directory / WEIGHTS_FILE)
    except (OSError, SafetensorError, ValueError, KeyError) as error:
        raise PredictorFileError(f"cannot read {directory / WEIGHTS_FILE}: {error}") from error
    try:
        predictor.restore(tensors, meta)
        predictor.train_config = TrainConfig(**meta.get("train", {}))
    except (KeyError, TypeError, ValueError) as error:
        raise PredictorFileError(f"{directory} does not hold a usable {predictor.kind} predictor ({error})") from error
    predictor.losses = list(meta.get("losses", []))


MAPPED = ("memory",)  # tensors mapped from the file rather than read
NUMPY_DTYPES = {"U8": np.uint8, "I8": np.int8, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64}


def _load(path: Path) -> dict[str, np.ndarray]:
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
