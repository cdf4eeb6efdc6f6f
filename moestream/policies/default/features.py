"""The inputs of the lean routing model for every row of a trace at once (`TraceFeatures`), which the
online state (state.py) keeps incrementally; also token keys, the vocabulary and the token memory.
Knows traces and arrays, not events or caches.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from moestream.policies.routing_stats import previous_rows
from moestream.predictors.paths import expert_mask
from moestream.trace.schema import Trace


def recall_weights(shared: np.ndarray, valid: np.ndarray, beta: float) -> np.ndarray:
    """[..., W] normalised weights exp(beta x shared) over the valid window slots."""
    w = np.exp(beta * shared) * valid  # [..., W]
    return w / np.maximum(w.sum(axis=-1, keepdims=True), 1e-12)


def token_keys(trace: "Trace") -> tuple[list | None, str]:
    """The trace's token keys (strings, else ids) and which kind they are ("" if none)."""
    if trace.tokens is not None:
        return trace.tokens, "tokens"
    if trace.token_ids is not None:
        return trace.token_ids.tolist(), "token_ids"
    return None, ""


def build_vocabulary(keys: list | None, min_count: int) -> dict[str, int]:
    """key -> index from 1, for keys seen at least min_count times; 0 is the unknown token."""
    counts = Counter(str(k) for k in keys or [])
    kept = sorted(k for k, n in counts.items() if n >= min_count)
    return {k: i + 1 for i, k in enumerate(kept)}


MEMORY_SCALE = 255.0  # the token memory's table holds its shares in 255ths (uint8)


class TokenMemory:
    """What each vocabulary token routes to, and what the token after it routes to, over a trace: the
    table [2V, L, E] holds at row v token v's mean routing and at V + v that of the tokens after v, each
    pulled toward every token's mean by one occurrence; row 0 (unknown) is that mean. A token reads its
    own row if known, else the one after its previous token, else row 0 (`memory_index`)."""

    def __init__(self, hot: np.ndarray, tokens: np.ndarray, prev: np.ndarray, vocab_size: int):
        has = prev >= 0
        before = tokens[prev[has]]  # the token before each row that has one
        self.sums = _sums(tokens, np.arange(len(tokens)), hot, vocab_size)  # [V, L, E]
        self.next_sums = _sums(before, np.flatnonzero(has), hot, vocab_size)  # [V, L, E]
        self.counts = np.bincount(tokens, minlength=vocab_size).astype(np.float32)  # [V]
        self.next_counts = np.bincount(before, minlength=vocab_size).astype(np.float32)  # [V]
        self.mean = hot.mean(axis=0, dtype=np.float32)  # [L, E] every token's

    def table(self) -> np.ndarray:
        """[2V, L, E] uint8, in 255ths (`memory_rows` reads it)."""
        own = (self.sums + self.mean) / (self.counts + 1.0)[:, None, None]
        own[0] = self.mean
        after = (self.next_sums + self.mean) / (self.next_counts + 1.0)[:, None, None]
        return np.round(np.concatenate([own, after]) * MEMORY_SCALE).astype(np.uint8)

    def without(self, hot_rows: np.ndarray, index: np.ndarray) -> np.ndarray:
        """[B, L, E] the rows of table() at `index` as if each row were left out of the trace."""
        V = len(self.counts)
        out = np.broadcast_to(self.mean, hot_rows.shape).copy()
        own, after = (index > 0) & (index < V), index >= V
        v, u = index[own], index[after] - V
        out[own] = (self.sums[v] - hot_rows[own] + self.mean) / self.counts[v][:, None, None]
        out[after] = (self.next_sums[u] - hot_rows[after] + self.mean) / self.next_counts[u][:, None, None]
        return out


def memory_rows(table: np.ndarray, index) -> np.ndarray:
    """float32 rows of TokenMemory's table (any index into its first axes)."""
    return table[index].astype(np.float32) / MEMORY_SCALE


def memory_index(tokens: np.ndarray, prev_tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Which row of TokenMemory's table each token reads (prev_tokens: its previous token, -1 if none)."""
    return np.where(tokens > 0, tokens, np.where(prev_tokens >= 0, vocab_size + prev_tokens, 0))


def _sums(keys: np.ndarray, rows: np.ndarray, hot: np.ndarray, size: int) -> np.ndarray:
    """[size, L, E] float32: hot[rows] ([N, L, E] bool) summed by key, a layer at a time."""
    from scipy.sparse import csr_matrix
    onehot = csr_matrix((np.ones(len(rows), np.float32), (keys, rows)), shape=(size, len(hot)))  # [size, N]
    return np.stack([np.asarray(onehot @ hot[:, layer].astype(np.float32)) for layer in range(hot.shape[1])], axis=1)


class TraceFeatures:
    """Every row's model inputs for one (layer, cut), computed for a whole trace."""

    def __init__(self, trace: "Trace", tokens: np.ndarray | None, memory: np.ndarray | None, window_tokens: int,
                 beta: float, cut_recall: bool = True):
        """tokens: the rows' vocabulary indices, None if the trace has no token keys the model knows."""
        self.trace, self.beta, self.cut_recall = trace, beta, cut_recall
        self.tokens = np.zeros(trace.num_tokens, np.int64) if tokens is None else tokens
        self.memory = memory  # [2V, L, E] the token memory's table
        E = trace.topology.num_experts
        self.hot = expert_mask(trace.experts, E)  # [N, L, E]
        self.prev = previous_rows(trace.seq_ids)  # [N]
        known = tokens is not None
        before = self.tokens[np.maximum(self.prev, 0)]
        self.before = np.where((self.prev >= 0) & known, before, -1)  # [N] the previous row's token
        self.prev2 = np.where(self.prev >= 0, self.prev[np.maximum(self.prev, 0)], -1)
        back = np.arange(1, window_tokens + 1)
        earlier = np.arange(len(self.prev))[:, None] - back  # [N, W]
        self.valid = back[None, :] <= np.minimum(trace.positions, _position_in_trace(trace.seq_ids))[:, None]
        self.earlier = np.where(self.valid, earlier, 0)
        self.share = _running_share(self.hot, self.prev)  # [N, L, E]
        self._shared: dict[int, np.ndarray] = {}  # cut -> [N, W] experts shared at cut

    def features(self, layer: int, cut: int, tokens: np.ndarray) -> np.ndarray:
        """[N, 7E] float32 inputs for `layer`, seen with each row's layers <= cut routed (-1: its start),
        its token shown as `tokens` (0: unknown)."""
        E = self.hot.shape[2]
        out = np.zeros((len(self.prev), 7 * E), dtype=np.float32)
        if cut >= 0:
            out[:, :E] = self.hot[:, cut]
        if cut >= 1:
            out[:, E:2 * E] = self.hot[:, cut - 1]
        for block, rows in ((2, self.prev), (3, self.prev2)):
            out[:, block * E:(block + 1) * E] = self.hot[np.maximum(rows, 0), layer] & (rows >= 0)[:, None]
        out[:, 4 * E:5 * E] = self.recall_many([layer], cut)[:, 0]
        out[:, 5 * E:6 * E] = self.share[:, layer]
        out[:, 6 * E:] = memory_rows(self.memory, (memory_index(tokens, self.before, len(self.memory) // 2), layer))
        return out

    def recall_many(self, layers: list[int], cut: int) -> np.ndarray:
        """[N, n, E]: the window's routing at each of `layers`, weighted by the experts shared at cut and
        cut-1 (without cut_recall: the window's mean), as one sparse [N, N] product."""
        from scipy.sparse import csr_matrix
        cut = cut if self.cut_recall else -1
        shared = sum(self._shared_at(c) for c in (cut, cut - 1) if c >= 0)
        weights = recall_weights(np.asarray(shared, dtype=np.float32), self.valid, self.beta)  # [N, W]
        n = len(self.prev)
        mix = csr_matrix((weights.ravel(), self.earlier.ravel(), np.arange(0, weights.size + 1, weights.shape[1])),
                         shape=(n, n))
        hot = self.hot[:, layers].reshape(n, -1).astype(np.float32)  # [N, n*E]
        return np.asarray(mix @ hot, dtype=np.float32).reshape(n, len(layers), -1)

    def _shared_at(self, cut: int) -> np.ndarray:
        if cut not in self._shared:
            experts = self.trace.experts[:, cut]  # [N, K]
            same = experts[self.earlier][:, :, :, None] == experts[:, None, None, :]  # [N, W, K, K]
            self._shared[cut] = same.sum(axis=(2, 3)).astype(np.float32)
        return self._shared[cut]


def _position_in_trace(seq_ids: np.ndarray) -> np.ndarray:
    """[N]: how many earlier rows of the same sequence precede each row."""
    starts = np.r_[True, seq_ids[1:] != seq_ids[:-1]] if len(seq_ids) else np.zeros(0, bool)
    first = np.maximum.accumulate(np.where(starts, np.arange(len(seq_ids)), 0))
    return np.arange(len(seq_ids)) - first


def _running_share(hot: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """[N, L, E] float32: mean routing of each row's earlier tokens in its sequence (0 if none)."""
    share = np.zeros(hot.shape, dtype=np.float32)
    total = np.zeros(hot.shape[1:], dtype=np.float32)
    count = 0
    for row in range(len(prev)):
        if prev[row] < 0:
            total[:], count = 0.0, 0
        elif count:
            share[row] = total / count
        total += hot[row]
        count += 1
    return share
