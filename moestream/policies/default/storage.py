"""Saving and loading a trained `default` model: weights.safetensors (numpy arrays, no torch)
plus predictor.json, in the format of moestream.policies.trained, each file written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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
    from safetensors.numpy import load_file

    directory = Path(directory)
    meta = read_meta(directory)
    if meta.get("kind") != predictor.kind:
        raise PredictorFileError(f"{directory} holds a {meta.get('kind')!r} predictor, not {predictor.kind!r}")
    check_topology(meta.get("topology"), predictor.topology, directory)
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, SafetensorError) as error:
        raise PredictorFileError(f"cannot read {directory / WEIGHTS_FILE}: {error}") from error
    try:
        predictor.restore(tensors, meta)
        predictor.train_config = TrainConfig(**meta.get("train", {}))
    except (KeyError, TypeError, ValueError) as error:
        raise PredictorFileError(f"{directory} does not hold a usable {predictor.kind} predictor ({error})") from error
    predictor.losses = list(meta.get("losses", []))
