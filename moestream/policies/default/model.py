"""The lean routing model of `default`: its settings, its weights and its one forward pass.

For a target layer l seen from a cut c, with b the bucket (0: l = c+1, 1: l = c+2, START: the token's
start) and a the anchor (c for buckets 0 and 1, l for START):
    pre = bias[a, b] + features @ dense[a, b] + token_embedding[t] @ token_out[a, b]    # [U]
and the logits are pre (linear) or relu(pre) @ out[a, b] + out_bias[a, b]; the features are seven
E-vectors (docs/default-policy.md). Only indexing, `@`, `+` and `*`: numpy runs it online, torch in training.
Knows arrays, not events, caches or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit

from moestream.predictors.configs import ConfigError

NUM_BUCKETS = 3  # d = 1, d = 2, the token's start
START = 2  # the bucket of a prediction that sees none of the token's own routing
NUM_BLOCKS = 7  # E-vectors in the features: cur, cur-1, prev, prev2, recall, share, memory
WEIGHT_NAMES = ("bias", "dense", "token", "token_out")
HIDDEN_NAMES = ("out", "out_bias")  # only with hidden_units > 0


@dataclass(frozen=True)
class DefaultConfig:
    """The model's sizes and the policy's prefetch bars."""

    window_tokens: int = 32  # earlier tokens of the sequence the recall weighs
    recall_beta: float = 0.5  # recall weight exp(beta x experts shared at c and c-1)
    token_rank: int = 16  # width of the token embedding
    hidden_units: int = 0  # 0: linear; else one ReLU layer of this width
    cut_recall: bool = True  # recall at c+1, c+2 weighted by the token's own routing (else the window mean)
    min_token_count: int = 3  # rarer training tokens map to the unknown token (index 0)
    min_prefetch_probability: float = 0.5
    idle_prefetch_probability: float = 0.1  # the bar while nothing moves to the tier
    duel_window_tokens: int = 16  # tokens of lookups over which the model duels recency (duel.py); 0: no duel

    def __post_init__(self):
        if self.window_tokens < 1 or self.token_rank < 1 or self.min_token_count < 1:
            raise ConfigError("window_tokens, token_rank and min_token_count must be >= 1")
        for name in ("duel_window_tokens", "hidden_units", "recall_beta"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        for name in ("min_prefetch_probability", "idle_prefetch_probability"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1]")


def weight_index(layer: int, cut: int) -> tuple[int, int]:
    """(anchor, bucket) of the weights predicting `layer` with layers <= cut routed."""
    return (cut, layer - cut - 1) if 0 <= cut and layer - cut <= 2 else (layer, START)


@dataclass
class DefaultWeights:
    """The model's arrays (numpy online, torch tensors in training)."""

    bias: Any  # [L, B, U]  (anchor, bucket); U = E when linear, else hidden_units
    dense: Any  # [L, B, 7E, U]
    token: Any  # [V, R]
    token_out: Any  # [L, B, R, U]
    out: Any = None  # [L, B, H, E] with a hidden layer
    out_bias: Any = None  # [L, B, E] with a hidden layer

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, vocab_size: int, rank: int, hidden: int = 0) -> "DefaultWeights":
        B, L, E = NUM_BUCKETS, num_layers, num_experts
        U = hidden or E
        extra = (np.zeros((L, B, U, E), np.float32), np.zeros((L, B, E), np.float32)) if hidden else ()
        return cls(np.zeros((L, B, U), np.float32), np.zeros((L, B, NUM_BLOCKS * E, U), np.float32),
                   np.zeros((vocab_size, rank), np.float32), np.zeros((L, B, rank, U), np.float32), *extra)

    def arrays(self) -> dict[str, Any]:
        names = WEIGHT_NAMES + (HIDDEN_NAMES if self.out is not None else ())
        return {name: getattr(self, name) for name in names}

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())


def pre_activation(w: DefaultWeights, features, tokens, index, first_row: int = 0):
    """[T, n, U] pre-activations of the n (anchor, bucket) weights that `index` selects; features
    [T, n, 7E - first_row] (the first `first_row` are zero); tokens [T, n] or [T, 1] vocabulary indices."""
    dense = features.swapaxes(0, 1) @ w.dense[index][..., first_row:, :]  # [n, T, U]
    token = w.token[tokens].swapaxes(0, 1) @ w.token_out[index]  # [n, T, U]
    return (dense + token).swapaxes(0, 1) + w.bias[index]  # [T, n, U]


def head(w: DefaultWeights, pre, index):
    """[T, n, E] logits from [T, n, U] pre-activations: themselves, or through the hidden layer."""
    if w.out is None:
        return pre
    hidden = (pre * (pre > 0)).swapaxes(0, 1)  # [n, T, H] ReLU
    return (hidden @ w.out[index]).swapaxes(0, 1) + w.out_bias[index]  # [T, n, E]


def logits(w: DefaultWeights, features, tokens, index):
    """[T, n, E] logits (pre_activation's arguments)."""
    return head(w, pre_activation(w, features, tokens, index), index)


sigmoid = expit  # probabilities from logits (scipy's, which does not overflow)
