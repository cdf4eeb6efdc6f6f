"""Token memory for the `default` routing model: how the training prompts' tokens with the same key
routed, recalled with the weighting of `recall.py`.

The memory keeps, for every known token (vocabulary index), at most `max_rows` of its training rows
(a seeded sample; the unknown token keeps none). For a token whose routing is known up to layer c,
each stored row of the same token is weighted by exp(BETA x the experts it shared with this token
at layers c-SPAN+1..c), and the memory at a target layer is the weighted mean of their multi-hots
there. It is the in-sequence recall's attention over other prompts' occurrences of the token: the
interaction of "which token" and "how it routed so far" that one hidden layer learns poorly. In
training, a row never recalls rows of its own sequence. Knows arrays; not traces, events or caches.
"""

from __future__ import annotations

import numpy as np

from moestream.policies.default.recall import UNKNOWN, masks


class TokenMemory:
    """Stored rows grouped by token: experts [M, L, K] with token v's rows at offsets[v]:offsets[v + 1]."""

    def __init__(self, experts: np.ndarray, offsets: np.ndarray, num_experts: int, seq_ids: np.ndarray | None = None):
        self.offsets = np.asarray(offsets, dtype=np.int64)  # [V + 1]
        self.experts = np.asarray(experts)  # [M, L, K]
        self.seq_ids = None if seq_ids is None else np.asarray(seq_ids)  # [M] the rows' sequences, while training only
        if len(self.experts) == 0:  # one padding row, never valid, so that gathers stay in range
            self.experts = np.zeros((1,) + self.experts.shape[1:], dtype=self.experts.dtype)
            self.seq_ids = None if seq_ids is None else np.zeros(1, dtype=np.int64)
        self.bit_sets = masks(self.experts, num_experts)  # [M, L, words]
        self.num_experts = num_experts

    @classmethod
    def build(cls, experts: np.ndarray, tokens: np.ndarray, seq_ids: np.ndarray, vocab_size: int, max_rows: int,
              rng: np.random.Generator, num_experts: int) -> "TokenMemory":
        """From a trace's experts [N, L, K], vocabulary indices tokens [N] and seq_ids [N]."""
        shuffled = rng.permutation(len(tokens))
        by_token = shuffled[np.argsort(tokens[shuffled], kind="stable")]
        sorted_tokens = tokens[by_token]
        rank = np.arange(len(by_token)) - np.searchsorted(sorted_tokens, sorted_tokens, side="left")
        rows = by_token[(rank < max_rows) & (sorted_tokens != UNKNOWN)]
        offsets = np.concatenate([[0], np.cumsum(np.bincount(tokens[rows], minlength=vocab_size))])
        return cls(experts[rows], offsets, num_experts, np.asarray(seq_ids)[rows])

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], num_experts: int) -> "TokenMemory | None":
        if "memory_experts" not in arrays:
            return None
        return cls(arrays["memory_experts"], arrays["memory_offsets"], num_experts)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"memory_experts": self.experts, "memory_offsets": self.offsets}

    def rows(self, tokens: np.ndarray, seq_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[n, R] each token's memory rows, padded to the most any has, and which are real; with
        seq_ids [n], rows of each token's own sequence are left out."""
        tokens = np.asarray(tokens, dtype=np.int64)
        start, count = self.offsets[tokens], self.offsets[tokens + 1] - self.offsets[tokens]
        width = max(int(count.max(initial=0)), 1)
        valid = np.arange(width)[None] < count[:, None]  # [n, R]
        index = np.where(valid, start[:, None] + np.arange(width)[None], 0)
        if seq_ids is not None and self.seq_ids is not None:
            valid &= self.seq_ids[index] != np.asarray(seq_ids)[:, None]
        return index, valid
