"""The base of the predictive baselines: their config, a predictor that scores experts per row
(online and for a whole trace with the same numbers), the `static` predictor, and the predictor that
sums pieces of log-odds evidence (`cooccur`, `token`, `token-cooccur` in `predictive.py`)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np

from moestream.contracts import Prediction, Predictor
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.routing_stats import (
    calibration_sample,
    fit_evidence_scale,
    layer_popularity,
    logit,
    sigmoid,
)
from moestream.predictors.paths import expert_mask, union_probability
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace


@dataclass(frozen=True)
class BaselineConfig:
    num_source_layers: int = 3  # cooccur: observed positions combined as evidence
    max_lag_layers: int = 8  # cooccur: lags counted directly; longer ones are chained
    token_prior_weight: float = 1.0  # token: pseudo-count of the layer-popularity prior
    num_pinned_per_layer: int | None = None  # static: None means top_k
    num_candidates_per_layer: int | None = None  # predictions per layer; None means 2 * top_k
    calibration_tokens: int = 4000  # training tokens that fit the evidence scale (0: no calibration)
    seed: int = 0  # of the calibration sample

    def __post_init__(self):
        if self.num_source_layers < 1 or self.max_lag_layers < 1:
            raise ValueError("num_source_layers and max_lag_layers must be >= 1")
        if self.calibration_tokens < 0:
            raise ValueError("calibration_tokens must be >= 0")
        if self.token_prior_weight <= 0:
            raise ValueError("token_prior_weight must be > 0")
        for name in ("num_pinned_per_layer", "num_candidates_per_layer"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class NotFittedError(MoestreamError):
    """A learned predictor was asked to score a trace before fit()."""


class RowScorePredictor(Predictor):
    """Scores every token row of the iteration for a target layer, then takes the batch's union."""

    def __init__(self, topology: Topology, config: BaselineConfig | None = None):
        super().__init__(topology)
        self.config = config or BaselineConfig()
        self.popularity: np.ndarray | None = None  # [L, E], set by fit
        self._ctx: IterationContext | None = None
        self._experts = np.zeros((0, topology.num_layers, topology.top_k), dtype=np.int64)  # [T, L, K]

    @property
    def num_candidates(self) -> int:
        return self.config.num_candidates_per_layer or 2 * self.topology.top_k

    def fit(self, trace: Trace) -> None:
        self.popularity = layer_popularity(trace)

    def reset(self) -> None:
        self._ctx = None

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._ctx = ctx
        self._experts = np.zeros((ctx.num_tokens, self.topology.num_layers, self.topology.top_k), dtype=np.int64)

    def observe(self, event: RoutingEvent) -> None:
        if self._ctx is not None:
            self._experts[:, event.layer] = event.expert_ids

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        if self._ctx is None or self.popularity is None or not self._ctx.num_tokens:
            return []
        predictions = []
        for target in range(layer_now + 1, layer_now + horizon_layers + 1):
            tokens_ahead, layer = divmod(target, self.topology.num_layers)
            scores = self.row_scores(layer_now, target)  # [T, E]
            batch = scores[0] if len(scores) == 1 else union_probability(scores)
            predictions += self._top(batch, layer, tokens_ahead)
        return predictions

    def _top(self, scores: np.ndarray, layer: int, tokens_ahead: int) -> list[Prediction]:
        order = np.argsort(-scores, kind="stable")[: self.num_candidates]
        return [Prediction(layer, int(e), float(scores[e]), tokens_ahead) for e in order if scores[e] > 0]

    def score_rows(self, trace: Trace, layer: int, horizon_layers: int) -> np.ndarray:
        """[N, E]: for each row t, the scores for (t, layer) that predict() gives when called
        horizon_layers stream positions earlier (see moestream.eval.prediction)."""
        if self.popularity is None:
            raise NotFittedError(f"{type(self).__name__} must be fitted before scoring a trace")
        return self.trace_scores(trace, layer, horizon_layers)

    @abstractmethod
    def row_scores(self, layer_now: int, target: int) -> np.ndarray:
        """[T, E] for stream position `target` (layer = target mod L, token = target div L)."""

    @abstractmethod
    def trace_scores(self, trace: Trace, layer: int, horizon_layers: int) -> np.ndarray:
        ...


class StaticPredictor(RowScorePredictor):
    """Always the num_pinned most popular experts of each layer, scored by their frequency."""

    def fit(self, trace: Trace) -> None:
        super().fit(trace)
        count = self.config.num_pinned_per_layer or self.topology.top_k
        top = np.argsort(-self.popularity, axis=1, kind="stable")[:, :count]  # [L, P]
        self.pinned_scores = np.zeros_like(self.popularity)
        np.put_along_axis(self.pinned_scores, top, np.take_along_axis(self.popularity, top, axis=1), axis=1)

    def pinned(self) -> frozenset[ExpertKey]:
        if self.popularity is None:
            return frozenset()
        return frozenset(ExpertKey(int(l), int(e)) for l, e in zip(*np.nonzero(self.pinned_scores)))

    def row_scores(self, layer_now: int, target: int) -> np.ndarray:
        layer = target % self.topology.num_layers
        return np.tile(self.pinned_scores[layer], (self._ctx.num_tokens, 1))

    def trace_scores(self, trace: Trace, layer: int, horizon_layers: int) -> np.ndarray:
        return np.tile(self.pinned_scores[layer], (trace.num_tokens, 1))


class EvidencePredictor(RowScorePredictor):
    """Scores = sigmoid(logit(layer popularity) + scale * evidence), the evidence in log-odds.

    fit() learns the statistics, then the scale on a sample of the training trace (scored
    in-sample, token counts left one out), so that scores are calibrated probabilities.
    """

    evidence_scale: float = 1.0

    def fit(self, trace: Trace) -> None:
        super().fit(trace)
        self.fit_statistics(trace)
        self.evidence_scale = 1.0
        if self.config.calibration_tokens and trace.num_tokens:
            sample = calibration_sample(trace, self.config.calibration_tokens, self.config.seed)
            labelled = [self._labelled(sample, layer) for layer in range(self.topology.num_layers)]
            self.evidence_scale = fit_evidence_scale(labelled)

    def _labelled(self, sample: Trace, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        evidence = self.trace_evidence(sample, layer, 1, in_sample=True)  # [N, E]
        routed = expert_mask(sample.experts[:, layer], self.topology.num_experts)  # [N, E]
        return evidence, logit(self.popularity[layer]), routed

    def row_scores(self, layer_now: int, target: int) -> np.ndarray:
        return self._scores(self.row_evidence(layer_now, target), target % self.topology.num_layers)

    def trace_scores(self, trace: Trace, layer: int, horizon_layers: int) -> np.ndarray:
        return self._scores(self.trace_evidence(trace, layer, horizon_layers), layer)

    def _scores(self, evidence: np.ndarray, layer: int) -> np.ndarray:
        return sigmoid(logit(self.popularity[layer]) + self.evidence_scale * evidence)

    @abstractmethod
    def fit_statistics(self, trace: Trace) -> None:
        ...

    @abstractmethod
    def row_evidence(self, layer_now: int, target: int) -> np.ndarray:
        """[T, E] log-odds evidence for stream position `target` from the iteration's state."""

    @abstractmethod
    def trace_evidence(self, trace: Trace, layer: int, horizon_layers: int, in_sample: bool = False) -> np.ndarray:
        """[N, E] the same for every row of a trace (in_sample: the rows were in the fit)."""
