"""In-sequence recall for the `default` routing model: what the same sequence's earlier tokens did
at a target layer, weighted by how alike their routing was to this token's just before it.

For a token whose routing is known up to layer c, each of the sequence's last WINDOW tokens u gets
the weight exp(BETA x shared_u), where shared_u counts the experts u shared with this token at
layers c-SPAN+1..c; the recall at target layer l is the weighted mean of the tokens' multi-hots at
l (a mean over the window when nothing is known yet). Tokens that routed alike so far tend to keep
routing alike, so this is attention over the sequence's own routing, the way fMoE's trajectory
search matches stored maps, without leaving the sequence. BETA and SPAN were chosen by how well
the recall alone predicts the next layer on the training prompts (docs/default-policy.md).
Knows arrays; not traces, events or caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

UNKNOWN = 0  # vocabulary index of the unknown token, which matches no other token
WINDOW = 128  # earlier tokens of the sequence that are recalled
SPAN = 5  # layers whose shared experts weigh a token
BETA = 0.5  # weight per shared expert, in log units


def span(cut: int) -> range:
    """The layers compared when layer `cut` is the last one known."""
    return range(max(cut - SPAN + 1, 0), cut + 1)


def weights(shared: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[n, W, ...] normalised over the window from shared counts [n, W, ...] and valid [n, W]."""
    valid = valid.reshape(valid.shape + (1,) * (shared.ndim - 2))
    shared = np.where(valid, shared, 0.0)
    w = np.exp(BETA * (shared - shared.max(axis=1, keepdims=True, initial=0.0))) * valid
    return w / np.maximum(w.sum(axis=1, keepdims=True), 1e-12)


def earlier_rows(first_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, W] rows of the same sequence's previous WINDOW tokens (most recent first) and which exist,
    for rows stored in sequence order; first_rows [N] is each row's sequence's first row."""
    rows = np.arange(len(first_rows))[:, None] - 1 - np.arange(WINDOW)[None]  # [N, W]
    valid = rows >= first_rows[:, None]
    return np.where(valid, rows, 0), valid


def same_token(tokens: np.ndarray, window_tokens: np.ndarray) -> np.ndarray:
    """[n, W]: which window tokens [n, W] are the row's own token [n] (vocabulary indices)."""
    return (window_tokens == tokens[:, None]) & (tokens != UNKNOWN)[:, None]


def first_rows(seq_ids: np.ndarray) -> np.ndarray:
    starts = np.ones(len(seq_ids), dtype=bool)
    starts[1:] = seq_ids[1:] != seq_ids[:-1]
    return np.maximum.accumulate(np.where(starts, np.arange(len(seq_ids)), 0))


def masks(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[..., words] uint64 bit sets of experts [..., K]."""
    words = -(-num_experts // 64)
    bits = np.left_shift(np.uint64(1), (experts % 64).astype(np.uint64))  # [..., K]
    word = (experts // 64).astype(np.int64)
    return np.stack([np.bitwise_or.reduce(np.where(word == i, bits, np.uint64(0)), axis=-1) for i in range(words)], axis=-1)


def shared_ids(current: np.ndarray, window: np.ndarray) -> np.ndarray:
    """[n, W, J]: experts each row shares with each window token per layer, from masks
    current [n, J, words] and window [n, W, J, words]."""
    return np.bitwise_count(current[:, None] & window).sum(axis=-1, dtype=np.float32)


def weighted_hot(w: np.ndarray, window_experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[n, J, E] = sum over the window of w [n, W, J] times the multi-hots of window_experts [n, W, J, K]."""
    n, _, num_layers, _ = window_experts.shape
    cells = (np.arange(n)[:, None, None, None] * num_layers + np.arange(num_layers)[None, None, :, None]) * num_experts
    index = (cells + window_experts).ravel()
    values = np.broadcast_to(w[..., None], window_experts.shape).ravel()
    return np.bincount(index, values, minlength=n * num_layers * num_experts).reshape(n, num_layers, num_experts)


def batch_recall(current: np.ndarray, window: np.ndarray, window_experts: np.ndarray, valid: np.ndarray,
                 cuts: np.ndarray, num_experts: int) -> np.ndarray:
    """[n, L, E] recall at every layer, each with its own last known layer cuts [n, L] (-1: none);
    current [n, L, words] the rows' masks, window [n, W, L, words] and window_experts [n, W, L, K]
    their window tokens' masks and experts, valid [n, W]."""
    shared = shared_ids(current, window)  # [n, W, L]
    cumulative = np.concatenate([np.zeros_like(shared[:, :, :1]), np.cumsum(shared, axis=2)], axis=2)  # [n, W, L+1]
    high = np.broadcast_to((cuts + 1)[:, None], shared.shape)
    low = np.broadcast_to(np.maximum(cuts - SPAN + 1, 0)[:, None], shared.shape)
    w = weights(np.take_along_axis(cumulative, high, 2) - np.take_along_axis(cumulative, low, 2), valid)  # [n, W, L]
    return weighted_hot(w, window_experts, num_experts).astype(np.float32)


def trace_recall(bit_sets: np.ndarray, source_sets: np.ndarray, source_experts: np.ndarray, window: np.ndarray,
                 valid: np.ndarray, cut: int, layer: int, num_experts: int, chunk_rows: int = 4096) -> np.ndarray:
    """[N, E] float32: every row's recall at `layer` with layers <= cut known, from the rows' masks
    bit_sets [N, L, words]; window, valid [N, W] index the source rows (source_sets [M, L, words],
    source_experts [M, L, K]): the trace itself for in-sequence recall (earlier_rows), or a memory."""
    layers = list(span(cut))
    known, source, targets = bit_sets[:, layers], source_sets[:, layers], source_experts[:, [layer]]
    out = np.zeros((len(bit_sets), num_experts), dtype=np.float32)
    for start in range(0, len(bit_sets), chunk_rows):
        rows = slice(start, start + chunk_rows)
        shared = shared_ids(known[rows], source[window[rows]]).sum(axis=2)  # [n, W]
        w = weights(shared, valid[rows])[:, :, None]  # [n, W, 1]
        out[rows] = weighted_hot(w, targets[window[rows]], num_experts)[:, 0]
    return out


def known_sets(current: np.ndarray, cut: int, num_experts: int) -> tuple[list[int], np.ndarray]:
    """The compared layers and one token's masks there [J, words], for its experts [L, K] known up to
    layer cut: computed once per token and layer, and shared by every recall channel."""
    layers = list(span(cut))
    return layers, masks(current[layers], num_experts)


def window_weights(known: tuple[list[int], np.ndarray], window_sets: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[W] for one token's known_sets over window tokens' masks [W, L, words] and valid [W]."""
    layers, current_sets = known
    shared = shared_ids(current_sets[None], window_sets[None][:, :, layers]).sum(axis=2)  # [1, W]
    return weights(shared, valid[None])[0]


class RecallWindow:
    """One sequence's last WINDOW tokens' routing, a ring (order does not matter): experts [W, L, K],
    their masks [W, L, words] and their tokens [W] (vocabulary indices)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.num_experts = num_experts
        self.experts = np.zeros((WINDOW, num_layers, top_k), dtype=np.int64)
        self.bit_sets = np.zeros((WINDOW, num_layers, -(-num_experts // 64)), dtype=np.uint64)
        self.tokens = np.full(WINDOW, UNKNOWN, dtype=np.int64)
        self.count = 0

    def push(self, experts: np.ndarray, token: int = UNKNOWN) -> None:
        """Adds a finished token's experts [L, K]."""
        slot = self.count % WINDOW
        self.experts[slot] = experts
        self.bit_sets[slot] = masks(experts, self.num_experts)
        self.tokens[slot] = token
        self.count += 1

    def history(self) -> "History":
        """The window as the History of one token row, the sequence's next."""
        slots = np.arange(WINDOW)
        return History(self.bit_sets, self.experts, self.tokens, slots[None], (slots < self.count)[None])


@dataclass(frozen=True)
class History:
    """Routing rows a recall may look back on, and for each of n token rows its sequence's earlier rows
    among them: the whole trace offline, one sequence's window online."""

    bit_sets: np.ndarray  # [M, L, words]
    experts: np.ndarray  # [M, L, K]
    tokens: np.ndarray  # [M] vocabulary indices
    earlier: np.ndarray  # [n, W] indices of each token row's earlier rows
    valid: np.ndarray  # [n, W] which of them exist


@dataclass(frozen=True)
class Sources:
    """The rows each of n token rows recalls: stored masks [M, L, words] and experts [M, L, K],
    index [n, R] into them and valid [n, R]."""

    bit_sets: np.ndarray
    experts: np.ndarray
    index: np.ndarray
    valid: np.ndarray

    def at(self, bit_sets: np.ndarray, cut: int, layer: int, num_experts: int) -> np.ndarray:
        """[n, E] at one layer, for token rows with masks bit_sets [n, L, words] known up to cut."""
        return trace_recall(bit_sets, self.bit_sets, self.experts, self.index, self.valid, cut, layer, num_experts)

    def batch(self, bit_sets: np.ndarray, cuts: np.ndarray, num_experts: int) -> np.ndarray:
        """[n, L, E] at every layer, each known up to its own cut [n, L]."""
        return batch_recall(bit_sets, self.bit_sets[self.index], self.experts[self.index], self.valid, cuts, num_experts)

    def row(self, i: int) -> "RowSources":
        return RowSources(self.bit_sets[self.index[i]], self.experts[self.index[i]], self.valid[i])


@dataclass(frozen=True)
class RowSources:
    """One token row's recalled rows, gathered once: masks [R, L, words], experts [R, L, K], valid [R]."""

    bit_sets: np.ndarray
    experts: np.ndarray
    valid: np.ndarray

    def weights(self, known: tuple[list[int], np.ndarray]) -> np.ndarray:
        """[R] for the token's known_sets."""
        return window_weights(known, self.bit_sets, self.valid)

    def recall(self, w: np.ndarray, targets: np.ndarray, num_experts: int) -> np.ndarray:
        """[n, E] at the target layers for weights w [R]."""
        chosen = self.experts[:, targets]  # [R, n, K]; weighted_hot for one row, without its broadcasts (hot path)
        index = (chosen + (np.arange(len(targets)) * num_experts)[None, :, None]).ravel()
        out = np.bincount(index, np.repeat(w, chosen[0].size), minlength=len(targets) * num_experts)
        return out.reshape(len(targets), num_experts).astype(np.float32)
