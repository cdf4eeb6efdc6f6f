"""Baselines: reactive caches (lru, lfu) and predictors learned offline from a trace.

`static` pins the most popular experts of each layer; `cooccur` combines, in log-odds, P(expert at a
later (token, layer) position | experts of the last few observed positions); `token` uses per-token
expert frequencies (popularity for unseen tokens and for the next token); `token-cooccur` both.
Scores are probabilities that one token (a batch: at least one of its tokens) routes to the expert; each
predictor scores a whole trace (`score_rows`) with the same numbers as online.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from moestream.contracts import EVICTIONS, POLICIES, EvictionPolicy, Policy, Prediction, Predictor
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.eviction import LRUPolicy, NarrowingEviction
from moestream.policies.routing_stats import (
    Cooccurrence,
    Evidence,
    TokenFrequencies,
    calibration_sample,
    fit_evidence_scale,
    layer_popularity,
    logit,
    previous_rows,
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
        count = self.config.num_candidates_per_layer or 2 * self.topology.top_k
        order = np.argsort(-scores, kind="stable")[:count]
        return [Prediction(layer, int(e), float(scores[e]), tokens_ahead) for e in order if scores[e] > 0]

    def score_rows(self, trace: Trace, layer: int, horizon_layers: int) -> np.ndarray:
        """[N, E]: each row's scores for `layer` as predict() gives them horizon_layers positions earlier."""
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
    """Scores = sigmoid(logit(layer popularity) + scale * evidence), the evidence in log-odds; fit() learns
    the statistics, then the scale on a sample of the trace (leave-one-out), so scores are calibrated."""

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


class CooccurPredictor(EvidencePredictor):
    """Later experts from the experts of the last num_source_layers observed positions."""

    def __init__(self, topology: Topology, config: BaselineConfig | None = None):
        super().__init__(topology, config)
        self.model: Cooccurrence | None = None
        self._last: dict[int, np.ndarray] = {}  # seq -> [L, K] of its last finished token
        self._carry = np.zeros((0, topology.num_layers, topology.top_k), dtype=np.int64)  # [T, L, K]
        self._has_carry = np.zeros(0, dtype=bool)  # [T]
        self._num_sources = min(self.config.num_source_layers, topology.num_layers)

    def fit_statistics(self, trace: Trace) -> None:
        self.model = Cooccurrence.fit(trace, self.config.max_lag_layers)

    def reset(self) -> None:
        super().reset()
        self._last.clear()

    def begin_iteration(self, ctx: IterationContext) -> None:
        super().begin_iteration(ctx)
        first = _edge_rows_of_sequences(ctx, last=False)
        self._has_carry = np.array([first[r] and int(s) in self._last for r, s in enumerate(ctx.seq_ids)], bool)
        self._carry = np.zeros_like(self._experts)
        for row in np.flatnonzero(self._has_carry):
            self._carry[row] = self._last[int(ctx.seq_ids[row])]

    def observe(self, event: RoutingEvent) -> None:
        super().observe(event)
        if self._ctx is not None and event.layer == self.topology.num_layers - 1:
            for row in np.flatnonzero(_edge_rows_of_sequences(self._ctx, last=True)):
                self._last[int(self._ctx.seq_ids[row])] = self._experts[row].copy()

    def end_sequence(self, seq_id: int) -> None:
        self._last.pop(int(seq_id), None)

    def row_evidence(self, layer_now: int, target: int) -> np.ndarray:
        num_layers, rows = self.topology.num_layers, self._ctx.num_tokens
        evidence = []
        for back in range(self._num_sources):
            rel = layer_now - back  # position relative to this token's first layer
            if rel >= 0:
                evidence.append(Evidence(self._experts[:, rel], np.ones(rows, bool), rel, target - rel))
            else:
                evidence.append(Evidence(self._carry[:, rel], self._has_carry, rel % num_layers, target - rel))
        return self.model.evidence(evidence, target % num_layers, rows)

    def trace_evidence(self, trace: Trace, layer: int, horizon_layers: int, in_sample: bool = False) -> np.ndarray:
        num_layers, prev = self.topology.num_layers, previous_rows(trace.seq_ids)
        rows = np.arange(trace.num_tokens)
        evidence = []
        for back in range(self._num_sources):
            rel = layer - horizon_layers - back
            source = rows
            for _ in range(-(rel // num_layers)):  # walk back to the token holding the position
                source = np.where(source >= 0, prev[np.maximum(source, 0)], -1)
            experts = trace.experts[np.maximum(source, 0), rel % num_layers].astype(np.int64)
            evidence.append(Evidence(experts, source >= 0, rel % num_layers, horizon_layers + back))
        return self.model.evidence(evidence, layer, trace.num_tokens)


class TokenPredictor(EvidencePredictor):
    """Per-token expert frequencies for the current token; popularity for the next one."""

    def __init__(self, topology: Topology, config: BaselineConfig | None = None):
        super().__init__(topology, config)
        self.frequencies: TokenFrequencies | None = None
        self._vocab_rows = np.zeros(0, dtype=np.int64)  # [T]

    def fit_statistics(self, trace: Trace) -> None:
        self.frequencies = TokenFrequencies.fit(trace, self.config.token_prior_weight)

    def begin_iteration(self, ctx: IterationContext) -> None:
        super().begin_iteration(ctx)
        if self.frequencies is not None:
            ids = None if ctx.token_ids is None else ctx.token_ids.tolist()
            self._vocab_rows = self.frequencies.rows_of(ids if self.frequencies.use_ids else ctx.tokens, ctx.num_tokens)

    def row_evidence(self, layer_now: int, target: int) -> np.ndarray:
        tokens_ahead, layer = divmod(target, self.topology.num_layers)
        if tokens_ahead:  # the next token is not known yet
            return np.zeros((self._ctx.num_tokens, self.topology.num_experts))
        return self._evidence(self.frequencies.score(self._vocab_rows, layer), layer)

    def trace_evidence(self, trace: Trace, layer: int, horizon_layers: int, in_sample: bool = False) -> np.ndarray:
        ids = None if trace.token_ids is None else trace.token_ids.tolist()
        vocab_rows = self.frequencies.rows_of(ids if self.frequencies.use_ids else trace.tokens, trace.num_tokens)
        exclude = trace.experts[:, layer].astype(np.int64) if in_sample else None
        evidence = self._evidence(self.frequencies.score(vocab_rows, layer, exclude), layer)
        if layer - horizon_layers < -1:  # predicted during the previous token, before this one is known
            evidence[previous_rows(trace.seq_ids) >= 0] = 0.0
        return evidence

    def _evidence(self, probabilities: np.ndarray, layer: int) -> np.ndarray:
        return logit(probabilities) - logit(self.popularity[layer])


class TokenCooccurPredictor(EvidencePredictor):
    """Token frequencies and co-occurrence as independent evidence, summed in log-odds."""

    def __init__(self, topology: Topology, config: BaselineConfig | None = None):
        super().__init__(topology, config)
        self.parts = (TokenPredictor(topology, self.config), CooccurPredictor(topology, self.config))

    def fit_statistics(self, trace: Trace) -> None:
        for part in self.parts:
            part.popularity = self.popularity
            part.fit_statistics(trace)

    def reset(self) -> None:
        super().reset()
        for part in self.parts:
            part.reset()

    def begin_iteration(self, ctx: IterationContext) -> None:
        super().begin_iteration(ctx)
        for part in self.parts:
            part.begin_iteration(ctx)

    def observe(self, event: RoutingEvent) -> None:
        for part in self.parts:
            part.observe(event)

    def end_sequence(self, seq_id: int) -> None:
        for part in self.parts:
            part.end_sequence(seq_id)

    def row_evidence(self, layer_now: int, target: int) -> np.ndarray:
        return sum(part.row_evidence(layer_now, target) for part in self.parts)

    def trace_evidence(self, trace: Trace, layer: int, horizon_layers: int, in_sample: bool = False) -> np.ndarray:
        return sum(part.trace_evidence(trace, layer, horizon_layers, in_sample) for part in self.parts)


def _edge_rows_of_sequences(ctx: IterationContext, last: bool) -> np.ndarray:
    """[T] bool: the row holding its sequence's earliest (or latest) position in this iteration."""
    order = np.lexsort((-ctx.positions if last else ctx.positions, ctx.seq_ids))
    edge = np.zeros(ctx.num_tokens, dtype=bool)
    sorted_seqs = ctx.seq_ids[order]
    edge[order[np.r_[True, sorted_seqs[1:] != sorted_seqs[:-1]]]] = True
    return edge


class PinnedLRU(NarrowingEviction):
    """LRU that passes over pinned experts unless every candidate is pinned."""

    def __init__(self, pinned: Callable[[], frozenset[ExpertKey]]):
        super().__init__(LRUPolicy())
        self.pinned = pinned

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        pinned = self.pinned()
        free = [key for key in candidates if key not in pinned]
        return self.inner.victim(free or list(candidates))


@POLICIES.register("static")
class StaticPolicy(Policy):
    """The most popular experts of each layer (from fit), predicted always and kept resident."""

    predictor_class = StaticPredictor

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return PinnedLRU(self.predictor.pinned)


@POLICIES.register("cooccur")
class CooccurPolicy(Policy):
    """Layer-to-layer co-occurrence prediction, LRU eviction."""

    predictor_class = CooccurPredictor


@POLICIES.register("token")
class TokenPolicy(Policy):
    """Per-token-id expert frequencies, LRU eviction. Needs token ids or strings in the trace."""

    predictor_class = TokenPredictor


@POLICIES.register("token-cooccur")
class TokenCooccurPolicy(Policy):
    """Token frequencies and co-occurrence together, LRU eviction."""

    predictor_class = TokenCooccurPredictor


@POLICIES.register("lru")
class LRU(Policy):
    """No prefetch; least-recently-used eviction (a Policy's defaults)."""


@POLICIES.register("lfu")
class LFU(Policy):
    """No prefetch; least-frequently-used eviction."""

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return EVICTIONS.create("lfu")
