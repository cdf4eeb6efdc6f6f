"""Routing statistics learned from a trace, shared by the predictive baselines: layer popularity,
co-occurrence across a stream of (token, layer) positions and per-token expert frequencies, each turned
into the probability that a token routes to an expert. Numpy only; no events, no policy logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moestream.errors import TraceError
from moestream.trace.schema import Trace

EPS = 1e-6


def layer_popularity(trace: Trace) -> np.ndarray:
    """[L, E]: fraction of tokens that route to each expert (a uniform prior for an empty trace)."""
    num_layers, num_experts, k = trace.topology.num_layers, trace.topology.num_experts, trace.topology.top_k
    if not trace.num_tokens:
        return np.full((num_layers, num_experts), k / num_experts)
    codes = (np.arange(num_layers)[None, :, None] * num_experts + trace.experts).ravel()  # [N*L*K]
    counts = np.bincount(codes, minlength=num_layers * num_experts).reshape(num_layers, num_experts)
    return counts / trace.num_tokens


def previous_rows(seq_ids: np.ndarray) -> np.ndarray:
    """[N]: the row of the same sequence's previous token, or -1 for a sequence's first token."""
    prev = np.arange(-1, len(seq_ids) - 1)
    if len(seq_ids):
        prev[np.r_[True, seq_ids[1:] != seq_ids[:-1]]] = -1
    return prev


def logit(p: np.ndarray) -> np.ndarray:
    p = np.minimum(np.maximum(p, EPS), 1.0 - EPS)
    return np.log(p) - np.log1p(-p)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def fit_evidence_scale(samples: list[tuple[np.ndarray, np.ndarray, np.ndarray]], max_steps: int = 25) -> float:
    """The a minimising the log loss of sigmoid(prior + a * evidence) (convex in a), by Newton; samples:
    (evidence [N, E], prior logit [E], routed [N, E] bool) per layer. a < 1 tempers overconfident sums."""
    scale = 1.0
    for _ in range(max_steps):
        grad = hess = 0.0
        for evidence, prior, routed in samples:
            p = sigmoid(prior + scale * evidence)
            grad += float(((p - routed) * evidence).sum())
            hess += float((p * (1.0 - p) * evidence * evidence).sum())
        if hess <= 0.0:
            break
        step = grad / hess
        scale = float(np.clip(scale - step, 0.05, 4.0))
        if abs(step) < 1e-4:
            break
    return scale


def calibration_sample(trace: Trace, max_tokens: int, seed: int) -> Trace:
    """Whole sequences drawn at random (seeded) until about max_tokens tokens."""
    bounds = trace.sequence_bounds()
    order = np.random.default_rng(seed).permutation(len(bounds))
    lengths = np.array([end - start for _, start, end in bounds])[order]
    count = int(np.searchsorted(np.cumsum(lengths), max_tokens)) + 1
    return trace.select(sorted(bounds[i][0] for i in order[:count]))


@dataclass(frozen=True)
class Evidence:
    """The experts observed at one earlier (token, layer) position, for every row being scored."""

    experts: np.ndarray  # [T, K]
    valid: np.ndarray  # [T] bool: the row has this position
    layer: int  # MoE layer of the position
    lag: int  # stream positions from it to the target (token t layer m is t*L + m)


class Cooccurrence:
    """P(expert b at stream position g + lag | expert a at position g), by g's layer and lag: lags past the
    last layer reach the next token; those past max_lag are chained. Evidence combines as naive Bayes."""

    def __init__(self, popularity: np.ndarray, tables: np.ndarray):
        self.popularity = popularity  # [L, E]
        self.tables = tables  # [L, max_lag, E, E]
        self._prior_logits = logit(popularity)  # [L, E]
        self._chained: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def fit(cls, trace: Trace, max_lag: int) -> "Cooccurrence":
        num_layers, num_experts = trace.topology.num_layers, trace.topology.num_experts
        popularity = layer_popularity(trace)
        experts, prev = trace.experts.astype(np.int64), previous_rows(trace.seq_ids)
        tables = np.empty((num_layers, max_lag, num_experts, num_experts), dtype=np.float32)
        for layer in range(num_layers):
            for lag in range(1, max_lag + 1):
                src, dst = _pairs(experts, prev, layer, lag)
                tables[layer, lag - 1] = _conditional(src, dst, popularity[(layer + lag) % num_layers])
        return cls(popularity, tables)

    def table(self, layer: int, lag: int) -> np.ndarray:
        """[E, E]: row a gives P(b at the target | a at `layer`), `lag` positions later."""
        max_lag = self.tables.shape[1]
        if lag <= max_lag:
            return self.tables[layer, lag - 1]
        if (layer, lag) not in self._chained:
            num_layers, k = self.popularity.shape[0], float(self.popularity[0].sum())  # k: top_k
            mid = (layer + max_lag) % num_layers
            self._chained[layer, lag] = (self.tables[layer, -1] / k) @ self.table(mid, lag - max_lag)
        return self._chained[layer, lag]

    def evidence(self, evidence: list[Evidence], target_layer: int, num_rows: int) -> np.ndarray:
        """[T, E]: summed log-odds evidence over the layer's popularity (0 for rows without any)."""
        prior = self._prior_logits[target_layer]  # [E]
        total = np.zeros((num_rows, len(prior)))
        for item in evidence:
            if item.valid.all():
                total += self._given(item, item.experts) - prior
            elif item.valid.any():
                rows = np.flatnonzero(item.valid)
                total[rows] += self._given(item, item.experts[rows]) - prior
        return total

    def _given(self, item: Evidence, experts: np.ndarray) -> np.ndarray:
        """[R, E]: logit of P(b | one of the row's K experts), averaged over the K."""
        return logit(self.table(item.layer, item.lag)[experts].sum(axis=1) / experts.shape[1])


def _pairs(experts: np.ndarray, prev: np.ndarray, layer: int, lag: int) -> tuple[np.ndarray, np.ndarray]:
    """(source [R, K], target [R, K]) expert sets `lag` stream positions apart, from `layer`."""
    num_layers = experts.shape[1]
    target_layer, tokens_ahead = (layer + lag) % num_layers, (layer + lag) // num_layers
    rows = np.arange(len(experts))
    for _ in range(tokens_ahead):
        rows = np.where(rows >= 0, prev[np.maximum(rows, 0)], -1)  # the source walks back
    ok = rows >= 0
    return experts[rows[ok], layer], experts[np.flatnonzero(ok), target_layer]


def _conditional(src: np.ndarray, dst: np.ndarray, target_popularity: np.ndarray) -> np.ndarray:
    """[E, E]: P(b in dst | a in src), with one pseudo-observation of the target's popularity."""
    num_experts = len(target_popularity)
    codes = np.empty((len(src), src.shape[1], dst.shape[1]), dtype=np.int64)  # [R, K, K]
    np.add(src[:, :, None] * num_experts, dst[:, None, :], out=codes)
    joint = np.bincount(codes.reshape(-1), minlength=num_experts * num_experts).reshape(num_experts, num_experts)
    seen = np.bincount(src.reshape(-1), minlength=num_experts)  # [E]
    return (joint + target_popularity) / (seen[:, None] + 1.0)


class TokenFrequencies:
    """P(expert e at layer l | input token v), smoothed toward layer popularity for rare tokens."""

    def __init__(self, use_ids: bool, vocab: dict, counts: np.ndarray, totals: np.ndarray, popularity, alpha: float):
        self.use_ids = use_ids  # keyed by token id, else by token string
        self.vocab = vocab  # key -> row of counts
        self.counts = counts  # [V, L, E] uint
        self.totals = totals  # [V]
        self.popularity = popularity  # [L, E]
        self.alpha = alpha

    @classmethod
    def fit(cls, trace: Trace, alpha: float) -> "TokenFrequencies":
        use_ids = trace.token_ids is not None
        if not use_ids and trace.tokens is None:
            raise TraceError("token-based prediction needs token ids or token strings in the trace")
        keys = trace.token_ids.tolist() if use_ids else trace.tokens
        vocab: dict = {}
        index = np.fromiter((vocab.setdefault(key, len(vocab)) for key in keys), dtype=np.int64, count=len(keys))
        counts = _token_counts(trace, index, len(vocab))
        totals = np.bincount(index, minlength=len(vocab))
        return cls(use_ids, vocab, counts, totals, layer_popularity(trace), alpha)

    def rows_of(self, keys, num_rows: int) -> np.ndarray:
        """[T]: vocabulary row of each key, -1 when unseen (all -1 when keys are None)."""
        if keys is None:
            return np.full(num_rows, -1)
        return np.fromiter((self.vocab.get(key, -1) for key in keys), dtype=np.int64, count=len(keys))

    def score(self, rows: np.ndarray, layer: int, exclude: np.ndarray | None = None) -> np.ndarray:
        """[T, E] for vocabulary rows (-1: unseen: the popularity); exclude [T, K]: left out (leave-one-out)."""
        prior = self.popularity[layer]
        seen = rows >= 0
        scores = np.tile(prior, (len(rows), 1))
        counts = self.counts[rows[seen], layer].astype(np.float64)  # [S, E]
        totals = self.totals[rows[seen]].astype(np.float64)  # [S]
        if exclude is not None:
            np.subtract.at(counts, (np.arange(len(counts))[:, None], exclude[seen]), 1.0)
            totals = totals - 1.0
        scores[seen] = (np.maximum(counts, 0.0) + self.alpha * prior) / (np.maximum(totals, 0.0)[:, None] + self.alpha)
        return scores


def _token_counts(trace: Trace, index: np.ndarray, vocab_size: int) -> np.ndarray:
    num_layers, num_experts = trace.topology.num_layers, trace.topology.num_experts
    cells = num_layers * num_experts
    codes = (index[:, None, None] * cells + np.arange(num_layers)[None, :, None] * num_experts + trace.experts).ravel()
    counts = np.bincount(codes, minlength=vocab_size * cells).reshape(vocab_size, num_layers, num_experts)
    dtype = np.uint16 if counts.max(initial=0) < 2**16 else np.uint32
    return counts.astype(dtype)
