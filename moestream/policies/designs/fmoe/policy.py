"""fMoE (Yu et al., "fMoE: Fine-Grained Expert Offloading for Large Mixture-of-Experts Serving"):
prefetching from a store of past iterations' expert maps, matched by input semantics and routing trajectory.

- Expert map: one sequence's gate distributions of one iteration, [L, E] (`RoutingEvent.gate_probs`, else
  1/k on each top-k id: `uses_one_hot_maps`); prefill averages its tokens'. A batch takes, per expert, the
  highest probability among its sequences' selections.
- Map store (`MapStore`): C maps, from fit() (one per token) and online (one per sequence per iteration);
  when full, a new map replaces the most redundant: (d/L) x semantic + ((L-d)/L) x trajectory similarity.
- Matching, prefetch distance d: after layer l the targets are l+1 .. l+min(horizon, d); those below d by
  semantic search (cosine of `IterationContext.embeddings`), the rest by trajectory (cosine of the layers
  observed so far). Without embeddings every target uses the trajectory: embeddings are never invented.
- Selection: `select_experts` (delta = 1 - similarity; ablations: a fixed top-k). Prefetch priority
  p / (l - l_now); eviction: the smallest p x freq (p in the latest matched map, freq the times routed to).
- Matching is incremental (one [S, E] x [E, C] product a layer); the engine runs it on a worker thread.
Knows nothing of time, bytes, the engine or the simulator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from moestream.contracts import POLICIES, EvictionPolicy, Policy, Prediction, Predictor, PrefetchPlanner
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.eviction import ScoredEviction
from moestream.policies.planning import ScorePlanner
from moestream.predictors.paths import expert_mask, unit_rows
from moestream.topology import Topology
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)


def one_hot_maps(experts: np.ndarray, num_experts: int, gate_probs: np.ndarray | None = None) -> np.ndarray:
    """[..., E] expert maps: gate_probs if given, else 1/K on each of the [..., K] routed experts."""
    if gate_probs is not None:
        return gate_probs.astype(np.float32)
    return expert_mask(experts, num_experts).astype(np.float32) * np.float32(1.0 / experts.shape[-1])


def cosine(dots: np.ndarray, norms_a: np.ndarray, norms_b: np.ndarray) -> np.ndarray:
    """dots [n, C] / (norms_a [n] x norms_b [C]); 0 where a norm is 0."""
    scale = norms_a[:, None] * norms_b[None, :]
    return np.divide(dots, scale, out=np.zeros_like(dots, dtype=np.float32), where=scale > 0)


def select_experts(probs: np.ndarray, similarity: np.ndarray, top_k: int, by_delta: bool) -> np.ndarray:
    """[S, E] bool: per row, experts by descending probability until their sum reaches delta = clip(1 -
    similarity, 0, 1), at least top_k (exactly, when not by_delta); ties come along, zeros never do."""
    num_rows, num_experts = probs.shape
    ranked = -np.sort(-probs, axis=1)  # [S, E] descending
    count = np.full(num_rows, min(top_k, num_experts))
    if by_delta:
        delta = np.clip(1.0 - similarity, 0.0, 1.0)  # [S]
        reached = (np.cumsum(ranked, axis=1) < delta[:, None]).sum(axis=1) + 1
        count = np.maximum(count, np.minimum(reached, num_experts))
    threshold = ranked[np.arange(num_rows), count - 1]  # [S]
    return (probs >= threshold[:, None]) & (probs > 0)


class MapStore:
    """At most C expert maps [C, L, E] with their unit embeddings, deduplicated by redundancy."""

    def __init__(self, num_layers: int, num_experts: int, capacity: int, prefetch_distance: int):
        self.capacity = capacity
        self.maps = np.zeros((capacity, num_layers, num_experts), dtype=np.float32)  # [C, L, E]
        self.prefix_sq = np.zeros((num_layers, capacity), dtype=np.float32)  # [L, C] |map[:l+1]|^2
        self.embeddings: np.ndarray | None = None  # [C, H] unit rows, zero where unknown
        self.size = 0
        d = min(prefetch_distance, num_layers)
        self.semantic_weight, self.trajectory_weight = d / num_layers, (num_layers - d) / num_layers

    def norms(self, layer: int = -1) -> np.ndarray:
        """[C] norm of each map over layers 0..layer (all layers by default)."""
        return np.sqrt(self.prefix_sq[layer])

    def redundancy(self, trajectory: np.ndarray, semantic: np.ndarray | None) -> np.ndarray:
        if semantic is None:
            return trajectory
        return self.semantic_weight * semantic + self.trajectory_weight * trajectory

    def add(self, expert_map: np.ndarray, embedding: np.ndarray | None, trajectory: np.ndarray,
            semantic: np.ndarray | None) -> int:
        """Store a map [L, E] (unit embedding [H] or None) given its cosines [C] with the stored maps and
        embeddings; returns its slot: the next free one, else the most redundant one."""
        slot = self.size if self.size < self.capacity else int(np.argmax(self.redundancy(trajectory, semantic)))
        self.maps[slot] = expert_map
        self.prefix_sq[:, slot] = np.cumsum((expert_map.astype(np.float32) ** 2).sum(axis=1))
        if embedding is not None and self.embeddings is None:
            self.embeddings = np.zeros((self.capacity, len(embedding)), dtype=np.float32)
        if self.embeddings is not None:
            self.embeddings[slot] = 0.0 if embedding is None else embedding
        self.size = max(self.size, slot + 1)
        return slot

    def add_many(self, maps: np.ndarray, embeddings: np.ndarray | None) -> None:
        """Add maps [n, L, E] (unit embeddings [n, H] or None) in order, as add() would one by one."""
        flat = maps.reshape(len(maps), -1)  # [n, L*E]
        norms = np.linalg.norm(flat, axis=1)
        trajectory = cosine(flat @ self.maps.reshape(self.capacity, -1).T, norms, self.norms())  # [n, C]
        own = cosine(flat @ flat.T, norms, norms)  # [n, n]
        semantic = own_semantic = None
        if embeddings is not None and self.embeddings is not None:
            semantic, own_semantic = embeddings @ self.embeddings.T, embeddings @ embeddings.T
        elif embeddings is not None:
            semantic, own_semantic = np.zeros_like(trajectory), embeddings @ embeddings.T
        for i, expert_map in enumerate(maps):
            sem_row = None if semantic is None else semantic[i]
            slot = self.add(expert_map, None if embeddings is None else embeddings[i], trajectory[i], sem_row)
            trajectory[i + 1 :, slot] = own[i + 1 :, i]  # later maps now meet map i in that slot
            if semantic is not None:
                semantic[i + 1 :, slot] = own_semantic[i + 1 :, i]


@dataclass(frozen=True)
class Match:
    slots: np.ndarray  # [S] best stored map of each sequence of the iteration
    similarity: np.ndarray  # [S] its cosine similarity


def best(similarities: np.ndarray, size: int) -> Match:
    """The best of the first `size` slots for each row of [S, C] similarities."""
    valid = similarities[:, :size]
    slots = np.argmax(valid, axis=1)
    return Match(slots, valid[np.arange(len(valid)), slots])


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
    """Matches each sequence's iteration against the map store; predicts the matched layers."""

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
            gates = None if trace.gate_probs is None else trace.gate_probs[rows]
            maps = one_hot_maps(trace.experts[rows], self.topology.num_experts, gates)  # [n, L, E]
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
        rows = one_hot_maps(event.expert_ids, self.topology.num_experts, event.gate_probs)  # [T, E]
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
    """Evicts the smallest p * freq (p: in the latest matched map; freq: times routed), ties to the LRU."""

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
