"""Predictors trained offline, their saved form, and the policy base that trains, saves and loads them
(the torch models live in moestream.predictors, imported lazily).

A trained predictor directory holds `weights.safetensors` and `predictor.json` (kind, topology, config and
anything else needed to rebuild it). Ablations share their design's kind, so they load the same directory.
"""

from __future__ import annotations

import json
import logging
from abc import abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from moestream.atomic import atomic_path, write_json
from moestream.contracts import Policy, Predictor
from moestream.errors import MoestreamError
from moestream.predictors.configs import TrainConfig
from moestream.topology import Topology

if TYPE_CHECKING:
    import torch

    from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.safetensors"
META_FILE = "predictor.json"
FORMAT_VERSION = 1


class PredictorFileError(MoestreamError):
    """A trained predictor directory that is missing, corrupt or made for another model."""


class TrainablePredictor(Predictor):
    """A predictor with a model learned by fit(), kept as tensors plus JSON metadata; `model` is a torch
    module (another kind of model overrides is_trained, tensors and the tensor files' two ends)."""

    kind: ClassVar[str] = ""  # the saved model's kind; a directory loads only into the same kind

    def __init__(self, topology: Topology, config: Any, train: TrainConfig):
        super().__init__(topology)
        self.config = config
        self.train_config = train
        self.losses: list[float] = []  # mean training loss of each epoch of the last fit
        self.model: "torch.nn.Module | None" = None

    @property
    def is_trained(self) -> bool:
        return self.model is not None

    def trained_model(self) -> "torch.nn.Module":
        if self.model is None:
            raise MoestreamError(f"the {self.kind} predictor is not trained: fit it on a trace or load a directory")
        return self.model

    def tensors(self) -> dict[str, "torch.Tensor"]:
        return dict(self.trained_model().state_dict())

    def meta(self) -> dict:
        return {"config": asdict(self.config)}

    def evaluate(self, trace: "Trace") -> dict[str, float]:
        """Named accuracy figures of the trained model on a (held-out) trace."""
        return {}

    @abstractmethod
    def restore(self, tensors: dict[str, "torch.Tensor"], meta: dict) -> None:
        ...

    def write_tensors(self, path: Path) -> None:
        from safetensors.torch import save_file
        save_file({name: t.detach().contiguous().cpu() for name, t in self.tensors().items()}, str(path))

    def read_tensors(self, path: Path) -> dict[str, "torch.Tensor"]:
        from safetensors.torch import load_file
        return load_file(path)


def read_meta(directory: Path) -> dict:
    path = directory / META_FILE
    if not path.is_file():
        raise PredictorFileError(f"no trained predictor in {directory} (missing {META_FILE})")
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PredictorFileError(f"cannot read {path}: {error}") from error
    if meta.get("format_version") != FORMAT_VERSION:
        raise PredictorFileError(f"{path} has format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    return meta


def check_topology(saved_dict, wanted: Topology, directory: Path) -> None:
    """Refuses a predictor saved for another routing shape (or with no valid topology)."""
    try:
        saved = Topology.from_dict(saved_dict)
    except (TypeError, ValueError) as error:
        raise PredictorFileError(f"{directory / META_FILE} has no valid topology ({error})") from error
    if not saved.routes_like(wanted):
        shape = (saved.num_layers, saved.num_experts, saved.top_k)
        expected = (wanted.num_layers, wanted.num_experts, wanted.top_k)
        raise PredictorFileError(f"{directory} was trained for (layers, experts, top_k) = {shape}, "
                                 f"this model has {expected}")


class TrainedPolicy(Policy):
    """A policy whose predictor is learned offline: fit() trains it, save()/load() keep it. Built with
    predictor_dir=DIR, it loads a trained predictor (`moestream train-predictor`'s) and fit() keeps it."""

    config_class: ClassVar[type] = object  # the design's config dataclass
    predictor: TrainablePredictor

    def __init__(self, topology: Topology, config: Any = None, train: TrainConfig | None = None,
                 predictor_dir: str | Path | None = None):
        self.config = self.config_class() if config is None else config
        self.train_config = TrainConfig() if train is None else train
        super().__init__(topology)
        self.pretrained = False
        if predictor_dir is not None:
            self.load(predictor_dir)

    def fit(self, trace: "Trace") -> None:
        if self.pretrained:
            log.info("%s: predictor loaded from a directory; fit() keeps it", self.registry_name)
            return
        self.predictor.fit(trace)

    def save(self, directory: str | Path) -> Path:
        """Writes the predictor's two files into directory (created if needed), each atomically."""
        predictor = self.predictor
        if not predictor.is_trained:
            raise MoestreamError(f"the {predictor.kind} predictor is not trained yet; fit it before saving")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / WEIGHTS_FILE) as path:
            predictor.write_tensors(path)
        meta = {"format_version": FORMAT_VERSION, "kind": predictor.kind, "topology": predictor.topology.to_dict(),
                "train": predictor.train_config.to_dict(), "losses": predictor.losses}
        write_json(meta | predictor.meta(), directory / META_FILE)
        return directory

    def load(self, directory: str | Path) -> None:
        """Loads a saved predictor after checking it fits; its saved config becomes the policy's, planner included."""
        from safetensors import SafetensorError
        predictor, directory = self.predictor, Path(directory)
        meta = read_meta(directory)
        if meta.get("kind") != predictor.kind:
            raise PredictorFileError(f"{directory} holds a {meta.get('kind')!r} predictor, not {predictor.kind!r}")
        check_topology(meta.get("topology"), predictor.topology, directory)
        try:
            tensors = predictor.read_tensors(directory / WEIGHTS_FILE)
        except (OSError, SafetensorError, ValueError, KeyError) as error:
            raise PredictorFileError(f"cannot read {directory / WEIGHTS_FILE}: {error}") from error
        try:
            predictor.restore(tensors, meta)
            predictor.train_config = TrainConfig(**meta.get("train", {}))
        except (KeyError, TypeError, ValueError, RuntimeError) as error:  # RuntimeError: tensors of other shapes
            error_text = f"{directory} does not hold a usable {predictor.kind} predictor ({error})"
            raise PredictorFileError(error_text) from error
        predictor.losses = list(meta.get("losses", []))
        self.config = self.loaded_config(self.predictor.config)
        self.planner = self.make_planner()
        self.pretrained = True

    def loaded_config(self, saved: Any) -> Any:
        """The config to run with after loading one saved with the predictor (a design may keep some of its own)."""
        return saved


def load_matching(policy: Policy, directories: Sequence[str | Path]) -> Path | None:
    """Loads into a trained policy the first directory of its predictor's kind; returns it (None: none)."""
    directory = matching_directory(policy, directories)
    if directory is not None:
        policy.load(directory)
    return directory


def matching_directory(policy: Policy, directories: Sequence[str | Path]) -> Path | None:
    """The first directory that holds a trained policy's predictor kind (None: none, or not trained)."""
    if not isinstance(policy, TrainedPolicy):
        return None
    return next((d for d in map(Path, directories) if read_meta(d).get("kind") == policy.predictor.kind), None)
