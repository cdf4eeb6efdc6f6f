"""fMoE (Yu et al., "fMoE: Fine-Grained Expert Offloading for Large Mixture-of-Experts Serving"):
prefetching from a store of past iterations' expert maps, matched by input semantics and by
routing trajectory.

- Expert map: one sequence's gate distributions of one iteration, [L, E] (`RoutingEvent.gate_probs`;
  from top-k ids only, 1/k on each, which `uses_one_hot_maps` reports); prefill averages its tokens'.
  A batch takes, per expert, the highest probability among its sequences' selections.
- Map store (maps.py): C maps, from fit() (one per trace token) and online (one per sequence per
  iteration); when full, a new map replaces the most redundant one: (d/L) x semantic similarity +
  ((L-d)/L) x trajectory similarity (the trajectory alone without embeddings).
- Matching, prefetch distance d: after layer l the targets are l+1 .. l+min(horizon, d) (each plan
  replaces the last); those below d by semantic search (cosine of `IterationContext.embeddings`),
  the rest by trajectory search (cosine of the layers observed so far). Without embeddings the
  predictor logs it once, `semantic_available` is False and every target uses the trajectory
  (nothing before an iteration's first layer): embeddings are never invented.
- Selection: maps.select_experts (delta = 1 - similarity; ablations: a fixed top-k). Prefetch
  priority p / (l - l_now) (ScorePlanner); eviction: the smallest p x freq (p in the latest matched
  map, freq the times routed to).
- Matching is incremental (one [S, E] x [E, C] product a layer); the engine runs it on a worker thread.

This module knows nothing of time, bytes, the engine or the simulator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from moestream.contracts import (
    POLICIES,
    EvictionPolicy,
    Policy,
    Prediction,
    Predictor,
    PrefetchPlanner,
)
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.designs.fmoe.maps import (
    MapStore,
    Match,
    best,
    cosine,
    one_hot_maps,
    select_experts,
)
from moestream.policies.planning import ScorePlanner
from moestream.policies.scored_eviction import ScoredEviction
from moestream.predictors.paths import unit_rows
from moestream.topology import Topology

if TYPE_CHECKING:
    from moestream.trace.schema import Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FMoEConfig:
    store_capacity: int = 1000  # C, expert maps kept
    prefetch_distance: int = 3  # d, layers ahead
    semantic: bool = True  # semantic search for target layers below d (when embeddings exist)
    delta_selection: bool = True  # similarity-aware selection; False: fixed top-k
    fit_chunk_tokens: int = 512  # maps compared with the store per matrix product in fit()

    def __post_init__(self):
        if self.store_capacity < 1 or self.prefetch_distance < 1 or self.fit_chunk_tokens < 1:
            raise ValueError("store_capacity, prefetch_distance and fit_chunk_tokens must be >= 1")


class FMoEPredictor(Predictor):
    """Matches each sequence's iteration against the map store; predicts the matched layers (one-hot
    maps keep exactly the top-k under delta selection). Asks for embeddings only with semantic search."""

    def __init__(self, topology: Topology, config: FMoEConfig = FMoEConfig()):
        super().__init__(topology)
        self.config = config
        self.needs_embeddings = config.semantic
        self.store = MapStore(topology.num_layers, topology.num_experts, config.store_capacity,
                              config.prefetch_distance)
        self.uses_one_hot_maps: bool | None = None  # None until maps were seen
        self.semantic_available = False
        self._warned = False
        self.reset()

    def fit(self, trace: "Trace") -> None:
        self.uses_one_hot_maps = trace.gate_probs is None
        semantic = self.config.semantic and trace.embeddings is not None
        step = self.config.fit_chunk_tokens
        for start in range(0, trace.num_tokens, step):
            rows = slice(start, start + step)
            if trace.gate_probs is None:
                maps = one_hot_maps(trace.experts[rows], self.topology.num_experts)  # [n, L, E]
            else:
                maps = trace.gate_probs[rows].astype(np.float32)
            embeddings = unit_rows(trace.embeddings[rows].astype(np.float32)) if semantic else None
            self.store.add_many(maps, embeddings)

    def reset(self) -> None:
        self.current_probs = np.zeros((self.topology.num_layers, self.topology.num_experts), np.float32)
        self._begin(np.zeros(0, dtype=np.int64), None)

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._begin(ctx.seq_ids, ctx.embeddings)

    def observe(self, event: RoutingEvent) -> None:
        if event.layer == 0 and (self._observed >= 0 or not np.array_equal(np.unique(event.seq_ids), self._seqs)):
            self._begin(event.seq_ids, None)  # no begin_iteration() came before this iteration
        if event.gate_probs is None:
            rows = one_hot_maps(event.expert_ids, self.topology.num_experts)  # [T, E]
        else:
            rows = event.gate_probs.astype(np.float32)
        self.uses_one_hot_maps = event.gate_probs is None
        one_row_each = np.array_equal(event.seq_ids, self._seqs)  # decode: one token per sequence, in order
        dist = rows if one_row_each else self._pooling(event.seq_ids) @ rows  # [S, E]
        self._dists[:, event.layer] = dist
        self._dots += dist @ self.store.maps[:, event.layer, :].T  # [S, C]
        self._sq += (dist**2).sum(axis=1)
        self._observed = event.layer
        if event.layer == self.topology.num_layers - 1:
            self._store_iteration()

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        last = min(self.topology.num_layers - 1, layer_now + min(horizon_layers, self.config.prefetch_distance))
        trajectory = self._trajectory_match(layer_now)
        first = layer_now + 1
        split = first if self._semantic is None else min(max(first, self.config.prefetch_distance), last + 1)
        predictions = self._select(range(first, split), self._semantic)  # target layers below d
        predictions += self._select(range(split, last + 1), trajectory)
        latest = self._semantic if trajectory is None else trajectory
        if latest is not None:
            self.current_probs = self.store.maps[latest.slots].max(axis=0)  # [L, E]
        return predictions

    def _begin(self, seq_ids: np.ndarray, embeddings: np.ndarray | None) -> None:
        self._seqs = np.unique(seq_ids)  # [S]
        num_seqs, store = len(self._seqs), self.store
        self._dists = np.zeros((num_seqs, self.topology.num_layers, self.topology.num_experts), np.float32)
        self._dots = np.zeros((num_seqs, store.capacity), dtype=np.float32)  # [S, C] trajectory dots
        self._sq = np.zeros(num_seqs, dtype=np.float32)  # [S] |observed trajectory|^2
        self._observed = -1
        self._embeddings = self._semantic_cos = self._semantic = None
        if self.config.semantic and num_seqs:
            self._begin_semantic(seq_ids, embeddings)

    def _begin_semantic(self, seq_ids: np.ndarray, embeddings: np.ndarray | None) -> None:
        self.semantic_available = embeddings is not None
        if embeddings is None:
            if not self._warned:
                log.warning("fmoe: no embeddings in the input; semantic matching is unavailable, "
                            "every layer uses trajectory matching")
                self._warned = True
            return
        self._embeddings = unit_rows(self._pooling(seq_ids) @ embeddings.astype(np.float32))  # [S, H]
        if self.store.embeddings is not None and self.store.size:
            self._semantic_cos = self._embeddings @ self.store.embeddings.T  # [S, C]
            self._semantic = best(self._semantic_cos, self.store.size)

    def _pooling(self, seq_ids: np.ndarray) -> np.ndarray:
        """[S, T]: averages the rows of each sequence of the iteration."""
        pooling = (self._seqs[:, None] == np.asarray(seq_ids)[None, :]).astype(np.float32)
        return pooling / np.maximum(pooling.sum(axis=1, keepdims=True), 1.0)

    def _trajectory_match(self, layer_now: int) -> Match | None:
        if layer_now < 0 or layer_now != self._observed or not self.store.size or not len(self._seqs):
            return None
        similarity = cosine(self._dots, np.sqrt(self._sq), self.store.norms(layer_now))  # [S, C]
        return best(similarity, self.store.size)

    def _select(self, layers: range, match: Match | None) -> list[Prediction]:
        if match is None or not len(layers):
            return []
        probs = self.store.maps[match.slots, layers.start : layers.stop]  # [S, D, E]
        num_seqs, depth, num_experts = probs.shape
        rows = probs.reshape(-1, num_experts)  # [S*D, E]
        chosen = select_experts(rows, np.repeat(match.similarity, depth), self.topology.top_k,
                                self.config.delta_selection)
        scores = np.where(chosen, rows, 0.0).reshape(num_seqs, depth, num_experts).max(axis=0)  # [D, E]
        found, experts = np.nonzero(scores > 0)
        values = np.minimum(scores[found, experts], 1.0).tolist()
        return [Prediction(layers.start + d, e, v) for d, e, v in zip(found.tolist(), experts.tolist(), values)]

    def _store_iteration(self) -> None:
        """Add each sequence's map of this iteration to the store (deduplicating)."""
        store, norms = self.store, np.sqrt(self._sq)
        for s in range(len(self._seqs)):
            trajectory = cosine(self._dots[s : s + 1], norms[s : s + 1], store.norms())[0]
            semantic = None if self._semantic_cos is None else self._semantic_cos[s]
            embedding = None if self._embeddings is None else self._embeddings[s]
            slot = store.add(self._dists[s], embedding, trajectory, semantic)
            later = slice(s + 1, None)
            self._dots[later, slot] = (self._dists[later] * self._dists[s]).sum(axis=(1, 2))
            if self._semantic_cos is not None:
                self._semantic_cos[later, slot] = self._embeddings[later] @ embedding


class FMoEEviction(ScoredEviction):
    """Evicts the smallest p * freq (p: probability in the latest matched map; freq: times routed
    to); ties go to the least recently used."""

    def __init__(self, predictor: FMoEPredictor):
        super().__init__()
        self.predictor = predictor
        self.freq = np.zeros((predictor.topology.num_layers, predictor.topology.num_experts), np.float64)

    def observe(self, event: RoutingEvent) -> None:
        freq = self.freq.copy()  # replaced, not changed in place: it is one of score_inputs()
        freq[event.layer] += np.bincount(event.expert_ids.ravel(), minlength=freq.shape[1])
        self.freq = freq

    def score_inputs(self) -> tuple:
        return self.predictor.current_probs, self.freq

    def score_matrix(self) -> np.ndarray:
        return self.predictor.current_probs * self.freq  # [L, E]


@POLICIES.register("fmoe")
class FMoE(Policy):
    """fMoE: semantic + trajectory map matching, similarity-aware (delta) selection, p * freq eviction."""

    config: ClassVar[FMoEConfig] = FMoEConfig()
    predicts_in_background: ClassVar[bool] = True

    def make_predictor(self) -> Predictor:
        self.map_predictor = FMoEPredictor(self.topology, self.config)
        return self.map_predictor

    def make_planner(self) -> PrefetchPlanner:
        return ScorePlanner()  # priority = p / (l - l_now)

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return FMoEEviction(self.map_predictor)


@POLICIES.register("fmoe-semantic")
class FMoESemantic(FMoE):
    """Ablation: trajectory + semantic matching, fixed top-k selection."""

    config: ClassVar[FMoEConfig] = replace(FMoEConfig(), delta_selection=False)


@POLICIES.register("fmoe-trajectory")
class FMoETrajectory(FMoE):
    """Ablation: trajectory matching only, fixed top-k selection."""

    config: ClassVar[FMoEConfig] = replace(FMoEConfig(), semantic=False, delta_selection=False)
