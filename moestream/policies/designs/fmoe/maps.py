"""fMoE's expert maps and their store: one-hot maps of a trace, cosine similarity, the map store
the predictor searches, and the selection of experts from a matched map. Arrays only; no events.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

def one_hot_maps(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[..., K] routed ids -> [..., E] distributions putting 1/K on each routed expert."""
    maps = np.zeros(experts.shape[:-1] + (num_experts,), dtype=np.float32)
    np.put_along_axis(maps, experts.astype(np.int64), 1.0 / experts.shape[-1], axis=-1)
    return maps


def cosine(dots: np.ndarray, norms_a: np.ndarray, norms_b: np.ndarray) -> np.ndarray:
    """dots [n, C] / (norms_a [n] x norms_b [C]); 0 where a norm is 0."""
    scale = norms_a[:, None] * norms_b[None, :]
    return np.divide(dots, scale, out=np.zeros_like(dots, dtype=np.float32), where=scale > 0)


def select_experts(probs: np.ndarray, similarity: np.ndarray, top_k: int, by_delta: bool) -> np.ndarray:
    """[S, E] bool: per row, experts by descending probability until their sum reaches
    delta = clip(1 - similarity, 0, 1), at least top_k (exactly top_k when not by_delta); experts
    tied with the last one chosen come along; zero-probability experts never do."""
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
        """Store a map ([L, E]; unit embedding [H] or None) given its cosines [C] with the stored
        maps and embeddings; returns its slot: the next free one, else the most redundant one."""
        if self.size < self.capacity:
            slot = self.size
        else:
            slot = int(np.argmax(self.redundancy(trajectory, semantic)))
        self.maps[slot] = expert_map
        self.prefix_sq[:, slot] = np.cumsum((expert_map.astype(np.float32) ** 2).sum(axis=1))
        self._put_embedding(slot, embedding)
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

    def _put_embedding(self, slot: int, embedding: np.ndarray | None) -> None:
        if embedding is not None and self.embeddings is None:
            self.embeddings = np.zeros((self.capacity, len(embedding)), dtype=np.float32)
        if self.embeddings is not None:
            self.embeddings[slot] = 0.0 if embedding is None else embedding


@dataclass(frozen=True)
class Match:
    slots: np.ndarray  # [S] best stored map of each sequence of the iteration
    similarity: np.ndarray  # [S] its cosine similarity


def best(similarities: np.ndarray, size: int) -> Match:
    """The best of the first `size` slots for each row of [S, C] similarities."""
    valid = similarities[:, :size]
    slots = np.argmax(valid, axis=1)
    return Match(slots, valid[np.arange(len(valid)), slots])
