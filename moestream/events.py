"""What the runtime tells policies as a batch moves through the model: plain, immutable records. Arrays
are numpy on the host; rows are tokens of the current iteration (one per sequence in decode, a whole prompt
in prefill). Nothing here knows how the events are produced or consumed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class IterationContext:
    step: int  # iteration counter, increasing across the whole run
    seq_ids: np.ndarray  # [T] int: the sequence each token row belongs to
    positions: np.ndarray  # [T] int: position of each token in its sequence
    is_prefill: bool
    token_ids: np.ndarray | None = None  # [T] int: input token ids of this iteration
    tokens: tuple[str, ...] | None = None  # [T] token strings, when known
    embeddings: np.ndarray | None = None  # [T, H] embedding-layer output, when a policy asks

    @property
    def num_tokens(self) -> int:
        return len(self.seq_ids)


@dataclass(frozen=True)
class RoutingEvent:
    layer: int  # MoE-layer index (0..L-1)
    expert_ids: np.ndarray  # [T, K] int: routed experts of each token
    seq_ids: np.ndarray  # [T] int
    positions: np.ndarray  # [T] int
    gate_weights: np.ndarray | None = None  # [T, K] float: weights applied to the routed experts
    gate_probs: np.ndarray | None = None  # [T, E] float: the router's full distribution
    hidden: np.ndarray | None = None  # [T, H] float: the router's input, when a policy asks

    def experts(self) -> np.ndarray:
        return np.unique(self.expert_ids)
