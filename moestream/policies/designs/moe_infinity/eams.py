"""Expert Activation Matrices (EAMs) and the collection (EAMC) MoE-Infinity matches against: building
them from a trace, k-means medoids, per-layer shares. Arrays only; no events, no policy.

The EAMC is chosen by k-means under the distance 1 - mean_l cos(M1[l], M2[l]), keeping per cluster
the member nearest the centroid. k-means runs (scikit-learn) on flattened EAMs whose rows are
L2-normalised: then ||x - y||^2 = 2 L x distance (a zero row counts as cosine 0 on both sides), so
squared Euclidean distance ranks pairs exactly like the paper's distance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moestream.predictors.paths import unit_rows

if TYPE_CHECKING:
    from moestream.trace.schema import Trace


def sequence_eams(trace: "Trace") -> np.ndarray:
    """One EAM per sequence of the trace, in trace order: [S, L, E] float32 token counts."""
    t = trace.topology
    offsets = (np.arange(t.num_layers) * t.num_experts)[None, :, None]  # [1, L, 1]
    flat = trace.experts.astype(np.int64) + offsets  # [N, L, K] index into L*E
    bounds = trace.sequence_bounds()
    eams = np.zeros((len(bounds), t.num_layers * t.num_experts), dtype=np.float32)
    for i, (_, start, end) in enumerate(bounds):
        eams[i] = np.bincount(flat[start:end].ravel(), minlength=t.num_layers * t.num_experts)
    return eams.reshape(len(bounds), t.num_layers, t.num_experts)


def layer_shares(eams: np.ndarray) -> np.ndarray:
    """ratio[l][e] = eam[l][e] / sum(eam[l]); all-zero rows stay zero. [..., L, E]."""
    sums = eams.sum(axis=-1, keepdims=True)
    return np.divide(eams, sums, out=np.zeros_like(eams, dtype=np.float32), where=sums > 0)


def build_collection(eams: np.ndarray, capacity: int, seed: int = 0) -> np.ndarray:
    """At most `capacity` representative EAMs: k-means medoids (see the module doc). [P, L, E]."""
    points = unit_rows(eams).reshape(len(eams), -1)  # [n, L*E]
    num_clusters = min(capacity, len(np.unique(points, axis=0)))
    if num_clusters >= len(eams):
        return eams.astype(np.float32, copy=True)
    from sklearn.cluster import KMeans

    kmeans = KMeans(n_clusters=num_clusters, n_init=1, random_state=seed).fit(points)
    spread = ((points - kmeans.cluster_centers_[kmeans.labels_]) ** 2).sum(axis=1)  # [n]
    order = np.lexsort((spread, kmeans.labels_))
    labels = kmeans.labels_[order]
    medoids = order[np.r_[True, labels[1:] != labels[:-1]]]
    return eams[np.sort(medoids)].astype(np.float32, copy=True)


@dataclass(frozen=True)
class EAMCollection:
    """The EAMC in the forms matching and prefetching need; replaced whole, never mutated."""

    eams: np.ndarray  # [P, L, E] token counts
    top_k: int  # experts routed per token
    version: int = 0
    ratios: np.ndarray = field(init=False)  # [P, L, E] per-layer shares
    top: np.ndarray = field(init=False)  # [P, L, E] bool: the top_k experts of each row
    unit: np.ndarray = field(init=False)  # [L, E, P] unit rows, laid out for per-layer matching

    def __post_init__(self):
        object.__setattr__(self, "ratios", layer_shares(self.eams))
        ranks = np.argsort(np.argsort(-self.ratios, axis=-1, kind="stable"), axis=-1)
        object.__setattr__(self, "top", ranks < self.top_k)
        object.__setattr__(self, "unit", np.ascontiguousarray(unit_rows(self.eams).transpose(1, 2, 0)))

    def __len__(self) -> int:
        return len(self.eams)
