"""ProMoE (Song et al., 2024): learned sliding-window predictors, speculative prefetch at low priority,
and the GOODPRED metric that picks how far ahead to predict.

- Predictor: per layer i and distance k (1..num_distances), a two-layer MLP maps layer i-k's router input
  (`RoutingEvent.hidden`) to layer i's experts (moestream.predictors.layer_mlp). `promoe-routing`, a
  labelled variant for routing-only traces, reads the multi-hot experts of layers i-k-w+1 .. i-k instead.
- Planner: speculative prefetches in a low priority band; chunking, preemption and reordering are the engine's.
- GOODPRED(i, k) = accuracy(i, k) x fetch-rate(k): measured by moestream.bench.tools.goodpred.
Knows routing events and hidden states as arrays, not time, bytes or torch modules (imported lazily).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from moestream.contracts import POLICIES, Prediction, PrefetchPlanner
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.planning import ScorePlanner
from moestream.policies.trained import TrainablePredictor, TrainedPolicy
from moestream.predictors.configs import ConfigError, TrainConfig
from moestream.predictors.paths import expert_mask, path_scores, top_k_mask
from moestream.topology import Topology

if TYPE_CHECKING:
    import torch

    from moestream.trace.schema import Trace


@dataclass
class PromoeConfig:
    num_distances: int = 3  # MLPs for k = 1..num_distances layers ahead (at most L-1)
    hidden_units: int = 256
    window_layers: int = 2  # promoe-routing: routing of layers i-k-w+1 .. i-k feeds layer i
    speculative_priority: float = 0.5  # speculative prefetches get priorities in (0, this]

    def __post_init__(self):
        if self.num_distances < 1 or self.hidden_units < 1 or self.window_layers < 1:
            raise ConfigError("num_distances, hidden_units and window_layers must be >= 1")
        if not 0.0 < self.speculative_priority <= 1.0:
            raise ConfigError(f"speculative_priority must be in (0, 1], got {self.speculative_priority}")


class PromoePredictor(TrainablePredictor):
    """Sliding-window MLPs: after layer l routes, scores the experts of layers l+1 .. l+num_distances."""

    standardize: ClassVar[bool] = False  # scale each input feature to zero mean, unit variance

    def __init__(self, topology: Topology, config: PromoeConfig, train: TrainConfig):
        super().__init__(topology, config, train)
        self._inputs: dict[int, np.ndarray] = {}  # layer -> [T, I] this iteration's input at that layer

    @abstractmethod
    def features(self):
        """The moestream.predictors.layer_mlp feature source that reads training rows."""

    @abstractmethod
    def event_input(self, event: RoutingEvent) -> np.ndarray:
        """[T, I] input of the event's layer, as features() gives it for training rows."""

    @property
    def num_distances(self) -> int:
        return self.trained_model().num_distances

    def fit(self, trace: "Trace") -> None:
        from moestream.predictors.layer_mlp import fit_sliding_window
        c = self.config
        self.model, self.losses = fit_sliding_window(
            trace, self.features(), c.hidden_units, c.num_distances, self.standardize, self.train_config
        )
        self.reset()

    def reset(self) -> None:
        self._inputs.clear()

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._inputs.clear()

    def observe(self, event: RoutingEvent) -> None:
        self._inputs[event.layer] = self.event_input(event)

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        if layer_now not in self._inputs:
            return []
        predictions = []
        for k in range(1, min(horizon_layers, self.num_distances, self.topology.num_layers - 1 - layer_now) + 1):
            scores = path_scores(self.probabilities(self._inputs[layer_now], layer_now, k), self.topology.top_k)  # [E]
            predictions += [Prediction(layer_now + k, int(e), float(scores[e])) for e in np.flatnonzero(scores)]
        return predictions

    def probabilities(self, inputs: np.ndarray, source_layer: int, distance: int) -> np.ndarray:
        """[T, I] inputs of source_layer -> [T, E] probabilities for layer source_layer + distance."""
        import torch

        from moestream.threads import torch_threads
        with torch.inference_mode(), torch_threads(1):
            return torch.sigmoid(self.trained_model().logits(torch.tensor(inputs), source_layer, distance)).numpy()

    def source_probabilities(self, trace: "Trace", source_layer: int, distance: int, chunk: int = 2048) -> np.ndarray:
        """[N, E] probabilities for layer source_layer + distance of every row of a trace."""
        features, parts = self.features(), []
        for start in range(0, trace.num_tokens, chunk):
            rows = np.arange(start, min(start + chunk, trace.num_tokens))
            inputs = features.rows(trace, rows)[:, source_layer].numpy()  # [B, I]
            parts.append(self.probabilities(inputs, source_layer, distance))
        return np.concatenate(parts) if parts else np.zeros((0, self.topology.num_experts), np.float32)

    def trace_probabilities(self, trace: "Trace", distance: int) -> np.ndarray:
        """[N, L-k, E] probabilities for layers k..L-1 of every row, from layers 0..L-1-k."""
        sources = range(self.topology.num_layers - distance)
        return np.stack([self.source_probabilities(trace, s, distance) for s in sources], axis=1)

    def score_rows(self, trace: "Trace", layer: int, horizon_layers: int) -> np.ndarray:
        """[N, E]: layer's experts as predicted when layer-horizon routed (none before layer 0 or too far)."""
        source = layer - horizon_layers
        if source < 0 or horizon_layers > self.num_distances:
            return np.zeros((trace.num_tokens, self.topology.num_experts), np.float32)
        return self.source_probabilities(trace, source, horizon_layers)

    def evaluate(self, trace: "Trace") -> dict[str, float]:
        """Top-k accuracy of layer i predicted from layer i-k, for each trained k."""
        actual = expert_mask(trace.experts, self.topology.num_experts)  # [N, L, E]
        figures = {}
        for k in range(1, self.num_distances + 1):
            predicted = top_k_mask(self.trace_probabilities(trace, k), self.topology.top_k)  # [N, L-k, E]
            figures[f"top-k accuracy (k={k})"] = float((predicted & actual[:, k:]).sum() / actual[:, k:].sum())
        return figures

    def restore(self, tensors: dict[str, "torch.Tensor"], meta: dict) -> None:
        from moestream.predictors.layer_mlp import SlidingWindowNet
        self.config = PromoeConfig(**meta["config"])
        t, num_distances = self.topology, int(meta["num_distances"])
        in_features = int(tensors["in_mean"].shape[1])
        net = SlidingWindowNet(t.num_layers, t.num_experts, in_features, self.config.hidden_units, num_distances)
        net.load_state_dict(tensors)
        self.model = net.eval()
        self.reset()

    def meta(self) -> dict:
        return super().meta() | {"num_distances": self.trained_model().num_distances}


class HiddenStatePredictor(PromoePredictor):
    """ProMoE's predictor: reads the router input (hidden state) of layer i-k."""

    kind = "promoe-hidden"
    needs_hidden = True
    standardize = True

    def features(self):
        from moestream.predictors.layer_mlp import HiddenFeatures
        return HiddenFeatures()

    def event_input(self, event: RoutingEvent) -> np.ndarray:
        if event.hidden is None:
            raise MoestreamError(f"promoe needs layer {event.layer}'s router input (RoutingEvent.hidden); none given")
        return np.asarray(event.hidden, dtype=np.float32)  # [T, H]


class RoutingWindowPredictor(PromoePredictor):
    """Routing-only variant: reads the experts of a window of earlier layers (not ProMoE's input)."""

    kind = "promoe-routing"
    standardize = False

    def features(self):
        from moestream.predictors.layer_mlp import RoutingFeatures
        return RoutingFeatures(self.config.window_layers)

    def event_input(self, event: RoutingEvent) -> np.ndarray:
        hot = expert_mask(event.expert_ids, self.topology.num_experts).astype(np.float32)  # [T, E]
        backs = range(self.config.window_layers - 1, 0, -1)
        earlier = [self._layer_hot(event.layer - back, len(hot)) for back in backs]
        return np.concatenate(earlier + [hot], axis=1)  # [T, W*E], oldest layer first

    def _layer_hot(self, layer: int, num_tokens: int) -> np.ndarray:  # [T, E]: the last E columns of its input
        if layer not in self._inputs:
            return np.zeros((num_tokens, self.topology.num_experts), np.float32)
        return self._inputs[layer][:, -self.topology.num_experts :]


def SpeculativePlanner(ceiling: float) -> ScorePlanner:
    """Speculative prefetch in a low priority band: priority = ceiling x score / layers ahead."""
    return ScorePlanner(scale=ceiling)


@POLICIES.register("promoe")
class Promoe(TrainedPolicy):
    """ProMoE: hidden-state sliding-window MLPs, speculative low-priority prefetch, LRU cache."""

    config_class = PromoeConfig
    trace_needs = ("hidden",)
    predicts_in_background = True  # the MLPs run on the CPU beside inference
    predictor: PromoePredictor

    def make_predictor(self) -> PromoePredictor:
        return HiddenStatePredictor(self.topology, self.config, self.train_config)

    def make_planner(self) -> PrefetchPlanner:
        return SpeculativePlanner(self.config.speculative_priority)

    def loaded_config(self, saved: PromoeConfig) -> PromoeConfig:  # the priority band stays this policy's
        return replace(saved, speculative_priority=self.config.speculative_priority)


@POLICIES.register("promoe-routing")
class PromoeRouting(Promoe):
    """Routing-only variant (not ProMoE's input): MLPs read earlier layers' experts, not hidden states."""

    trace_needs = ()

    def make_predictor(self) -> PromoePredictor:
        return RoutingWindowPredictor(self.topology, self.config, self.train_config)

