"""Sequence-level reuse of experts for the `default` policy: the probability that the next token of a
sequence to pass layer l routes to expert e, from that sequence's history at l.

Features of (l, e) (all from the sequence so far): routed by the last token to pass l, by the one
before it, three exponentially decayed usage averages (rates 0.5, 0.8, 0.95), the running share
of tokens routed to e (the EAM row), the logit of e's popularity at l in the training trace, and
log(1 + tokens that passed l). A logistic regression over them (fitted by Newton's method with a
small L2 penalty) gives calibrated probabilities; they score the next token's experts and drive
eviction. `SequenceState` keeps one sequence's history and is updated layer by layer.
Knows traces and arrays, not events or caches.
"""

from __future__ import annotations

import numpy as np

from moestream.policies.default.model import sigmoid
from moestream.policies.default.recall import UNKNOWN, RecallWindow
from moestream.predictors.paths import expert_mask
from moestream.trace.schema import Trace

RATES = np.array([0.5, 0.8, 0.95], dtype=np.float32)
NUM_FEATURES = 8
EPS = 1e-4


class SequenceState:
    """One sequence's routing history, per MoE layer."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        L, E = num_layers, num_experts
        self.last = np.zeros((L, E), dtype=np.float32)  # multi-hot of the last token to pass each layer
        self.before = np.zeros((L, E), dtype=np.float32)
        self.decay = np.zeros((len(RATES), L, E), dtype=np.float32)
        self.counts = np.zeros((L, E), dtype=np.float32)
        self.passes = np.zeros(L, dtype=np.float32)
        self.prev_experts = np.zeros((L, top_k), dtype=np.int64)  # the last complete token's experts
        self.has_prev = False
        self.window = RecallWindow(L, E, top_k)  # the last tokens' routing, for the routing model's recall

    def update(self, layer: int, experts: np.ndarray) -> None:
        hot = np.zeros(self.last.shape[1], dtype=np.float32)
        hot[experts] = 1.0
        self.before[layer] = self.last[layer]
        self.last[layer] = hot
        self.decay[:, layer] = RATES[:, None] * self.decay[:, layer] + (1.0 - RATES)[:, None] * hot
        self.counts[layer] += hot
        self.passes[layer] += 1.0

    def finish_token(self, experts: np.ndarray, token: int = UNKNOWN) -> None:
        """A token of the sequence (experts [L, K], vocabulary index token) has passed every layer."""
        self.window.push(experts, token)
        self.prev_experts = np.array(experts, dtype=np.int64)
        self.has_prev = True

    def affinity(self, layers) -> np.ndarray:
        """[n, E]: share of the tokens that passed each layer routed to each expert."""
        return self.counts[layers] / np.maximum(self.passes[layers], 1.0)[:, None]


def features(last, before, decay, share, pop_logit, passes) -> np.ndarray:
    """[..., E, F] from per-layer arrays [..., E] (decay [R, ..., E]; passes [...])."""
    log_passes = np.broadcast_to(np.log1p(passes)[..., None], last.shape)
    parts = [last, before, *decay, share, np.broadcast_to(pop_logit, last.shape), log_passes]
    return np.stack(parts, axis=-1).astype(np.float32)


class ReuseModel:
    """Logistic regression of 'the next token to pass layer l routes to e' on sequence features."""

    def __init__(self, pop_logit: np.ndarray, weights: np.ndarray | None = None):
        self.pop_logit = np.asarray(pop_logit, dtype=np.float32)  # [L, E]
        # untrained: follow the last token and popularity
        default = np.array([1.0, 0.3, 0.5, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0], dtype=np.float32)
        self.weights = default if weights is None else np.asarray(weights, dtype=np.float32)  # [F + 1]

    def state_probs(self, state: SequenceState, layers) -> np.ndarray:
        """[n, E] for the given layers of one sequence."""
        share = state.affinity(layers)
        x = features(state.last[layers], state.before[layers], state.decay[:, layers], share,
                     self.pop_logit[layers], state.passes[layers])
        return sigmoid(x @ self.weights[:-1] + self.weights[-1])

    def fit(self, trace: Trace, max_tokens: int, l2: float, seed: int) -> None:
        """Learns the weights from up to max_tokens (token, next token) pairs of trace."""
        rows = _pairs(trace, max_tokens, seed)
        if not len(rows):
            return
        x, y = [], []
        for layer in range(trace.topology.num_layers):
            x_layer, _ = self.trace_features(trace, layer, rows)
            x.append(x_layer.reshape(-1, NUM_FEATURES))
            y.append(expert_mask(trace.experts[rows + 1, layer], trace.topology.num_experts).astype(np.float32).ravel())
        self.weights = newton_logistic(np.concatenate(x), np.concatenate(y), l2)

    def trace_probs(self, trace: Trace, layer: int) -> np.ndarray:
        """[N, E]: after each row's token, the probability for the sequence's next token at layer."""
        x, _ = self.trace_features(trace, layer, np.arange(trace.num_tokens))
        return sigmoid(x @ self.weights[:-1] + self.weights[-1])

    def trace_features(self, trace: Trace, layer: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[len(rows), E, F] features of `layer` just after each of `rows` (sorted), and the rows."""
        E = trace.topology.num_experts
        hot = expert_mask(trace.experts[:, layer], E).astype(np.float32)  # [N, E]
        out = np.zeros((len(rows), E, NUM_FEATURES), dtype=np.float32)
        wanted = np.zeros(trace.num_tokens, dtype=bool)
        wanted[rows] = True
        slot = np.cumsum(wanted) - 1
        for _, start, end in trace.sequence_bounds():
            if wanted[start:end].any():
                self._sequence(hot[start:end], wanted[start:end], out, slot[start:end], layer)
        return out, rows

    def _sequence(self, hot, wanted, out, slot, layer) -> None:
        E = hot.shape[1]
        last, before = np.zeros(E, np.float32), np.zeros(E, np.float32)
        decay, counts = np.zeros((len(RATES), E), np.float32), np.zeros(E, np.float32)
        for i in range(len(hot)):
            before, last = last, hot[i]
            decay = RATES[:, None] * decay + (1.0 - RATES)[:, None] * last
            counts = counts + last
            if wanted[i]:
                out[slot[i]] = features(last, before, decay, counts / (i + 1), self.pop_logit[layer], np.float32(i + 1))


def newton_logistic(x: np.ndarray, y: np.ndarray, l2: float, steps: int = 12) -> np.ndarray:
    """[F + 1] weights (bias last) minimising mean log loss + l2/2 |w|^2 (bias unpenalised)."""
    x = np.concatenate([x, np.ones((len(x), 1), dtype=np.float32)], axis=1).astype(np.float64)
    w = np.zeros(x.shape[1])
    penalty = np.full(x.shape[1], l2)
    penalty[-1] = 0.0
    for _ in range(steps):
        p = sigmoid(x @ w)
        grad = x.T @ (p - y) / len(x) + penalty * w
        hess = (x * (p * (1 - p))[:, None]).T @ x / len(x) + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-6:
            break
    return w.astype(np.float32)


def _pairs(trace: Trace, max_tokens: int, seed: int) -> np.ndarray:
    """Sorted rows whose next row is the same sequence's next token, at most max_tokens of them."""
    same = np.flatnonzero(trace.seq_ids[1:] == trace.seq_ids[:-1])
    if len(same) > max_tokens:
        same = np.sort(np.random.default_rng(seed).choice(same, size=max_tokens, replace=False))
    return same


def popularity_logit(trace: Trace, prior_tokens: float = 1.0) -> np.ndarray:
    """[L, E] logit of the share of tokens routed to each expert (smoothed towards top_k / E)."""
    t = trace.topology
    counts = np.zeros((t.num_layers, t.num_experts), dtype=np.float64)
    for layer in range(t.num_layers):
        counts[layer] = np.bincount(trace.experts[:, layer].ravel().astype(np.int64), minlength=t.num_experts)
    share = (counts + prior_tokens * t.top_k / t.num_experts) / (trace.num_tokens + prior_tokens)
    share = np.clip(share, EPS, 1 - EPS)
    return (np.log(share) - np.log1p(-share)).astype(np.float32)
