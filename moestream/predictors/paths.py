"""Routing paths as boolean masks and scores, and unit rows for cosine matching: numpy helpers shared by
predictors, policies and metrics.

No torch here, so that policies and evaluation can use them without importing the models.
"""

from __future__ import annotations

import numpy as np


def top_k_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the k highest scores along the last axis."""
    top = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, top, True, axis=-1)
    return mask


def union_probability(probs: np.ndarray) -> np.ndarray:
    """[T, ..., E] per-token probabilities -> [..., E]: the chance that any token needs the expert."""
    return 1.0 - np.prod(1.0 - probs, axis=0)


def path_scores(probs: np.ndarray, top_k: int) -> np.ndarray:
    """[T, ..., E] token probabilities -> [..., E]: the batch's OR'd predicted path (each token's top-k),
    scored by the chance that any token needs the expert; experts off every token's path score 0."""
    if len(probs) == 0:
        return np.zeros(probs.shape[1:])
    predicted = top_k_mask(probs, top_k).any(axis=0)
    return np.where(predicted, np.clip(union_probability(probs), 1e-6, 1.0), 0.0)


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows (the last axis) scaled to unit L2 norm; all-zero rows stay zero."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return np.divide(vectors, norms, out=np.zeros_like(vectors, dtype=np.float32), where=norms > 0)


def expert_mask(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[..., K] expert ids -> [..., E] bool."""
    mask = np.zeros((*experts.shape[:-1], num_experts), dtype=bool)
    np.put_along_axis(mask, experts.astype(np.int64), True, axis=-1)
    return mask
