"""ExpertFlow's routing path model: a small transformer encoder over a causal window of token ids
(the token and the tokens before it in its sequence) with one E-way head per MoE layer, trained with
binary cross-entropy against each token's recorded experts. It predicts a token's whole routing
path, every layer at once, before the iteration's first layer runs.

It knows traces and token ids; nothing about caches, planners or the engine.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
import torch
from torch import nn

from moestream.errors import TraceError
from moestream.predictors.configs import RoutingPathConfig, TrainConfig
from moestream.predictors.training import multi_hot, seeded, train_loop
from moestream.threads import torch_threads
from moestream.trace.schema import Trace

PAD, UNK = 0, 1  # reserved vocabulary indices


class Vocabulary:
    """Token ids or token strings -> model indices (PAD and UNK reserved), built from training data."""

    def __init__(self, source: str, keys: Sequence):
        self.source = source  # "token_ids" or "tokens": which iteration field it reads
        self.keys = list(keys)
        self._index = {key: i + 2 for i, key in enumerate(self.keys)}

    @classmethod
    def build(cls, source: str, values: Sequence, max_size: int, min_count: int) -> "Vocabulary":
        counts = Counter(values)
        kept = [key for key, n in counts.most_common(max_size) if n >= min_count]
        return cls(source, kept)

    def __len__(self) -> int:
        return len(self.keys) + 2

    def encode(self, values: Sequence) -> np.ndarray:
        return np.fromiter((self._index.get(v, UNK) for v in values), dtype=np.int64, count=len(values))

    def to_dict(self) -> dict:
        return {"source": self.source, "keys": self.keys}

    @classmethod
    def from_dict(cls, data: dict) -> "Vocabulary":
        return cls(data["source"], data["keys"])


def token_values(trace: Trace) -> tuple[str, list]:
    """(source, one value per row): engine traces give token ids, imported ones token strings."""
    if trace.token_ids is not None:
        return "token_ids", trace.token_ids.astype(np.int64).tolist()
    if trace.tokens is not None:
        return "tokens", list(trace.tokens)
    name = trace.source or "(unnamed)"
    raise TraceError(f"trace {name} has neither token_ids nor tokens; the routing path model needs one")


def context_windows(ids: np.ndarray, seq_starts: np.ndarray, window: int) -> np.ndarray:
    """[N] ids and each row's first row of its sequence -> [N, W] windows ending at the row, PAD-filled."""
    rows = np.arange(len(ids))
    back = np.arange(window - 1, -1, -1)  # column j holds the token `back[j]` rows earlier
    src = rows[:, None] - back[None, :]  # [N, W]
    valid = src >= seq_starts[:, None]
    return np.where(valid, ids[np.clip(src, 0, None)], PAD)  # [N, W]


def sequence_starts(trace: Trace) -> np.ndarray:
    starts = np.empty(trace.num_tokens, dtype=np.int64)
    for _, start, end in trace.sequence_bounds():
        starts[start:end] = start
    return starts  # [N]


class RoutingPathModel(nn.Module):
    def __init__(self, config: RoutingPathConfig, vocab_size: int, num_layers: int, num_experts: int):
        super().__init__()
        self.num_layers, self.num_experts = num_layers, num_experts
        self.embed = nn.Embedding(vocab_size, config.model_dim, padding_idx=PAD)
        self.position = nn.Parameter(torch.randn(config.window_tokens, config.model_dim) * 0.02)
        block = nn.TransformerEncoderLayer(
            config.model_dim, config.num_heads, config.ff_dim, config.dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(block, config.num_blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.model_dim)
        self.heads = nn.Linear(config.model_dim, num_layers * num_experts)  # L heads of E logits, stacked

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        x = self.embed(windows) + self.position  # [B, W, D]
        h = self.encoder(x, src_key_padding_mask=windows == PAD)  # [B, W, D]
        current = self.norm(h[:, -1])  # [B, D]: the token being routed (never padding)
        return self.heads(current).view(-1, self.num_layers, self.num_experts)  # [B, L, E] logits


def fit_routing_path(
    trace: Trace, config: RoutingPathConfig, train: TrainConfig
) -> tuple[RoutingPathModel, Vocabulary, list[float]]:
    """Learns a routing path model on every token of trace; returns it, its vocabulary and epoch losses."""
    if trace.num_tokens == 0:
        raise TraceError("cannot train a routing path model on an empty trace")
    source, values = token_values(trace)
    vocab = Vocabulary.build(source, values, config.max_vocab, config.min_token_count)
    windows = torch.from_numpy(context_windows(vocab.encode(values), sequence_starts(trace), config.window_tokens))
    topology = trace.topology
    loss_fn = nn.BCEWithLogitsLoss()

    with seeded(train.seed, train.num_threads):
        model = RoutingPathModel(config, len(vocab), topology.num_layers, topology.num_experts)

        def batch_loss(rows: np.ndarray) -> torch.Tensor:
            logits = model(windows[rows])  # [B, L, E]
            return loss_fn(logits, multi_hot(trace.experts[rows], topology.num_experts))

        losses = train_loop(model, batch_loss, trace.num_tokens, train, desc="routing path model")
    return model, vocab, losses


@torch.inference_mode()
def path_probabilities(model: RoutingPathModel, windows: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """[T, W] windows -> [T, L, E] sigmoid probabilities that each expert routes the token."""
    model.eval()
    with torch_threads(1):
        starts = range(0, len(windows), batch_size)
        parts = [torch.sigmoid(model(torch.from_numpy(windows[i : i + batch_size]))) for i in starts]
    if not parts:
        return np.zeros((0, model.num_layers, model.num_experts), dtype=np.float32)
    return torch.cat(parts).numpy()
