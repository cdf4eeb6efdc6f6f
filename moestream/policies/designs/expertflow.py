"""ExpertFlow (He et al., 2024): routing path prediction, predictive locality-aware caching and
real-time correction.

- Predictor: a routing path model (moestream.predictors.routing_path) predicts every layer's experts from
  the tokens and their context before the first layer runs; a batch's path ORs its tokens' top-k.
- Planner: predicted experts of the upcoming layers, nearest layer first, up to capacity.
- Eviction (real-time correction): prefetched experts the gate did not route go first (`-nocorrect`: LRU).
Knows token ids and routing events, not time, bytes or torch modules (imported lazily).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np

from moestream.contracts import (
    EVICTIONS,
    POLICIES,
    CacheView,
    EvictionPolicy,
    Prediction,
    PrefetchPlanner,
    TransferRequest,
)
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.eviction import LRUPolicy
from moestream.policies.planning import ranked
from moestream.policies.trained import TrainablePredictor, TrainedPolicy
from moestream.predictors.configs import RoutingPathConfig, TrainConfig
from moestream.predictors.paths import expert_mask, path_scores, top_k_mask
from moestream.topology import ExpertKey, Topology
from moestream.trace.replay import batched_rows

if TYPE_CHECKING:
    import torch

    from moestream.trace.schema import Trace


class ExpertFlowPredictor(TrainablePredictor):
    """Predicts the routing path of the iteration's tokens from their token-id context."""

    kind = "expertflow-routing-path"

    def __init__(self, topology: Topology, config: RoutingPathConfig, train: TrainConfig):
        super().__init__(topology, config, train)
        self.vocab = None
        self._history: dict[int, list[int]] = {}  # seq -> its last window_tokens vocabulary indices
        self._scores: np.ndarray | None = None  # [L, E] chance a predicted expert is needed; 0 if not predicted
        self._by_layer: list[list[Prediction]] = []  # this iteration's predictions of each layer
        self._scored: tuple["Trace", np.ndarray] | None = None  # the last trace score_rows saw, its [N, L, E]

    def fit(self, trace: "Trace") -> None:
        from moestream.predictors.routing_path import fit_routing_path
        self.model, self.vocab, self.losses = fit_routing_path(trace, self.config, self.train_config)
        self.reset()

    def reset(self) -> None:
        self._history.clear()
        self._scores = None
        self._by_layer = []
        self._scored = None

    def begin_iteration(self, ctx: IterationContext) -> None:
        from moestream.predictors.routing_path import path_probabilities
        self.trained_model()
        values = ctx.token_ids if self.vocab.source == "token_ids" else ctx.tokens
        if values is None:
            raise MoestreamError(f"the routing path model reads {self.vocab.source}; this iteration has none")
        windows = self._windows(ctx.seq_ids, self.vocab.encode(np.asarray(values).tolist()))  # [T, W]
        self._scores = path_scores(path_probabilities(self.trained_model(), windows), self.topology.top_k)
        self._by_layer = [
            [Prediction(layer, int(e), float(scores[e])) for e in np.flatnonzero(scores)]
            for layer, scores in enumerate(self._scores)
        ]

    def end_sequence(self, seq_id: int) -> None:
        self._history.pop(int(seq_id), None)

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        last = min(self.topology.num_layers - 1, layer_now + horizon_layers)
        return [p for layer in self._by_layer[layer_now + 1 : last + 1] for p in layer]

    def predicted_scores(self) -> np.ndarray | None:
        """[L, E] scores of this iteration's predicted path (0 where not predicted), None before one."""
        return self._scores

    def trace_probabilities(self, trace: "Trace") -> np.ndarray:
        """[N, L, E] per-token probabilities for every row of a trace, in one batched pass."""
        from moestream.predictors.routing_path import context_windows, path_probabilities, sequence_starts, token_values

        source, values = token_values(trace)
        if source != self.vocab.source:
            raise MoestreamError(f"the routing path model reads {self.vocab.source}, the trace gives {source}")
        windows = context_windows(self.vocab.encode(values), sequence_starts(trace), self.config.window_tokens)
        return path_probabilities(self.trained_model(), windows)

    def score_rows(self, trace: "Trace", layer: int, horizon_layers: int) -> np.ndarray:
        """[N, E]: each token's path as predicted at its start; nothing when predicted at the previous token
        (layer < horizon-1), except for a sequence's first token."""
        if self._scored is None or self._scored[0] is not trace:
            self._scored = (trace, self.trace_probabilities(trace))
        scores = self._scored[1][:, layer]  # [N, E]
        if layer - horizon_layers >= -1:
            return scores
        from moestream.predictors.routing_path import sequence_starts
        first = sequence_starts(trace) == np.arange(trace.num_tokens)  # [N]
        return np.where(first[:, None], scores, 0.0)

    def evaluate(self, trace: "Trace") -> dict[str, float]:
        """Top-k accuracy of every (token, layer) predicted at the iteration start, and batch accuracy."""
        predicted = top_k_mask(self.trace_probabilities(trace), trace.topology.top_k)  # [N, L, E]
        actual = expert_mask(trace.experts, trace.topology.num_experts)  # [N, L, E]
        figures = {"top-k accuracy (iteration start)": float((predicted & actual).sum() / actual.sum())}
        for size in (1, 8):
            batches = (rows for rows, _ in batched_rows(trace, size))
            figures[f"batch path accuracy (B={size})"] = batch_path_accuracy(predicted, actual, batches).accuracy
        return figures

    def meta(self) -> dict:
        return super().meta() | {"vocab": self.vocab.to_dict()}

    def restore(self, tensors: dict[str, "torch.Tensor"], meta: dict) -> None:
        from moestream.predictors.routing_path import RoutingPathModel, Vocabulary
        self.config = RoutingPathConfig(**meta["config"])
        self.vocab = Vocabulary.from_dict(meta["vocab"])
        t = self.topology
        model = RoutingPathModel(self.config, len(self.vocab), t.num_layers, t.num_experts)
        model.load_state_dict(tensors)
        self.model = model.eval()
        self.reset()

    def _windows(self, seq_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
        from moestream.predictors.routing_path import PAD
        width = self.config.window_tokens
        windows = np.full((len(ids), width), PAD, dtype=np.int64)  # [T, W]
        for row, (seq, token) in enumerate(zip(seq_ids.tolist(), ids.tolist())):
            history = self._history.setdefault(seq, [])
            history.append(token)
            del history[:-width]
            windows[row, width - len(history) :] = history
        return windows


class LayerOrderPlanner(PrefetchPlanner):
    """Predicted experts nearest layer first, then by score, up to capacity; priorities decrease from 1."""

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        ordered = ranked(predictions, view, lambda score, layer, ahead: (-ahead, score))
        return [TransferRequest(key, (len(ordered) - i) / len(ordered)) for i, (key, _, _, _) in enumerate(ordered)]


@EVICTIONS.register("expertflow-correction")
class CorrectionEviction(EvictionPolicy):
    """ExpertFlow's real-time correction as a victim order, least recently used first within a group:
    1. the current layer's experts inserted in this iteration that its gate did not route;
    2. its other unrouted experts, then layers already computed, latest first;
    3. later layers' experts not predicted (all, without a predictor), furthest layer first;
    4. later layers' predicted experts, least likely first;
    5. experts the current layer routed (in use now).
    """

    def __init__(self, predictor: ExpertFlowPredictor | None = None):
        self.predictor = predictor
        self._by_layer: dict[int, OrderedDict[ExpertKey, None]] = {}  # resident keys, LRU first
        self._layer_now = -1
        self._routed: frozenset[int] = frozenset()  # experts the gate of _layer_now routed
        self._fresh: set[ExpertKey] = set()  # inserted during this iteration

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._layer_now, self._routed = -1, frozenset()
        self._fresh.clear()

    def observe(self, event: RoutingEvent) -> None:
        self._layer_now = event.layer
        self._routed = frozenset(event.expert_ids.ravel().tolist())

    def on_insert(self, key: ExpertKey) -> None:
        self._fresh.add(key)
        self.on_access(key)

    def on_access(self, key: ExpertKey) -> None:
        layer = self._by_layer.setdefault(key.layer, OrderedDict())
        layer[key] = None
        layer.move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._by_layer.get(key.layer, {}).pop(key, None)
        self._fresh.discard(key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        for group in self._groups():
            for key in group:
                if key in candidates:  # the cache's candidates answer `in` in O(1)
                    return key
        return candidates[0]

    def _groups(self) -> Iterator[Iterable[ExpertKey]]:
        now, routed = self._layer_now, self._routed
        current = self._by_layer.get(now, {})
        yield (key for key in current if key.expert not in routed and key in self._fresh)
        yield (key for key in current if key.expert not in routed)
        for layer in sorted((layer for layer in self._by_layer if layer < now), reverse=True):
            yield self._by_layer[layer]
        later = [key for layer in sorted(self._by_layer, reverse=True) if layer > now for key in self._by_layer[layer]]
        scores = None if self.predictor is None else self.predictor.predicted_scores()
        if scores is None:
            yield later
        else:
            yield (key for key in later if scores[key] <= 0.0)
            yield sorted(later, key=lambda key: scores[key])
        yield current


@POLICIES.register("expertflow")
class ExpertFlow(TrainedPolicy):
    """Routing path prediction, layer-ordered predictive caching and real-time correction."""

    config_class = RoutingPathConfig
    predictor: ExpertFlowPredictor

    def make_predictor(self) -> ExpertFlowPredictor:
        return ExpertFlowPredictor(self.topology, self.config, self.train_config)

    def make_planner(self) -> PrefetchPlanner:
        return LayerOrderPlanner()

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return CorrectionEviction(self.predictor)


@POLICIES.register("expertflow-nocorrect")
class ExpertFlowNoCorrect(ExpertFlow):
    """Ablation: ExpertFlow without real-time correction (LRU eviction)."""

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return LRUPolicy()


@dataclass(frozen=True)
class BatchPathAccuracy:
    """Per batch, the OR of its tokens' paths, predicted vs true: the share of the true one predicted
    (accuracy) and of the predicted one needed (precision), averaged over batches."""

    accuracy: float
    precision: float
    num_batches: int


def batch_path_accuracy(predicted: np.ndarray, actual: np.ndarray, batches: Iterable[np.ndarray]) -> BatchPathAccuracy:
    """predicted, actual: [N, L, E] bool per-token paths; batches: the rows of each batch."""
    recalls, precisions = [], []
    for rows in batches:
        pred, true = predicted[rows].any(axis=0), actual[rows].any(axis=0)  # [L, E]
        hits = np.count_nonzero(pred & true)
        recalls.append(hits / max(1, np.count_nonzero(true)))
        precisions.append(hits / max(1, np.count_nonzero(pred)))
    if not recalls:
        raise MoestreamError("batch path accuracy needs at least one batch")
    return BatchPathAccuracy(float(np.mean(recalls)), float(np.mean(precisions)), len(recalls))

