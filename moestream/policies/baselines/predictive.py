"""Predictive baselines learned offline from a trace: static popularity, co-occurrence, token id.

`static` pins the most popular experts of each layer; `cooccur` combines, in log-odds, P(expert at a
later (token, layer) position | experts of the last few observed positions); `token` uses per-token
expert frequencies (popularity for unseen tokens and for the next token); `token-cooccur` both.
Scores are probabilities that one token routes to the expert (a batch's: at least one of its tokens);
each predictor also scores a whole trace at once (`score_rows`) with the same numbers.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from moestream.contracts import (
    POLICIES,
    EvictionPolicy,
    Policy,
)
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.baselines.row_scores import (
    BaselineConfig,
    EvidencePredictor,
    StaticPredictor,
)
from moestream.policies.eviction import LRUPolicy, NarrowingEviction
from moestream.policies.routing_stats import (
    Cooccurrence,
    Evidence,
    TokenFrequencies,
    logit,
    previous_rows,
)
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace


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
