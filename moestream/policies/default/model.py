"""The routing model of the `default` policy: P(expert e of layer l is routed | what is known d layers
before l), one small MLP for every target layer and horizon, trained offline with torch and run online
in numpy.

For a token and a target MoE layer l, seen after layer c = l - d of the same token has routed:
    z      = sum_{j <= c} A_j[experts of j] (+ G_j gate_probs_j when the trace has them)   # the prefix
           + sum_{i < R} Q_{i,c-i}[experts of c-i]                                           # the latest layers again
           + T[token] + P[position bucket] + B[previous token's experts at every layer]     # the context
           + U_l + V_d + sum_c x^c_l @ R^c_l                                                  # the recall channels
    logits = relu(layernorm(z)) @ W_l + b_l + s_l * previous_l + r_l * affinity_l + sum_c k^c_l * x^c_l
           (+ relu(rms_normalised(router input of layer c) @ W_in_c) @ W_out_{l,min(d,D)} when the trace has
              hidden states: ProMoE's idea, a two-layer MLP from an earlier router's input per distance,
              as its own path)
The latest R layers (num_recent_layers) are embedded a second time, apart from the prefix sum, so
that the layers nearest the target weigh more than a sum can make them. previous_l is the sequence's
previous token's multi-hot at l and affinity_l the sequence's running share of tokens routed to
each expert at l (its EAM row, as in MoE-Infinity). The recall channels x^c_l are routing at l of
other tokens, weighted by how alike they routed up to c (`recall.py`): "recall" the sequence's
earlier tokens, "repeat" the sequence's earlier occurrences of the same token, "memory" the training
prompts' occurrences of it (`memory.py`).
The model is an ensemble: `num_members` such networks, initialised apart, each trained on its own
loss, with their logits averaged. It runs as one network whose hidden units are the members' side by
side, each block with its own layer norm (`join_members`).
Training minimises the binary cross-entropy of every (token, layer), each with a horizon d drawn at random, so the same
weights serve the whole-iteration prediction (c = -1, only token context) and its refinement as
layers route. Tokens seen fewer than `min_token_count` times, and a share of the others while
training, map to the unknown token, so that traces without token strings still work.
This module knows traces and arrays; not events, policies or caches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import scipy.sparse

from moestream.policies.default.channels import CHANNELS
from moestream.policies.default.memory import TokenMemory
from moestream.policies.default.recall import UNKNOWN
from moestream.predictors.configs import ConfigError
from moestream.predictors.paths import expert_mask
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

NUM_POSITION_BUCKETS = 12
READOUTS = {"out_w": 1, "hidden_out": 2}  # arrays from hidden units to experts, and their hidden axis
PER_EXPERT = ("out_b", "skip")  # arrays with no hidden axis (besides each channel's "_skip")


@dataclass(frozen=True)
class ModelConfig:
    hidden_dim: int = 1024  # per member
    dropout: float = 0.2
    min_token_count: int = 3  # rarer training tokens map to the unknown token
    token_dropout: float = 0.1  # share of training tokens shown as unknown
    next_layer_share: float = 0.5  # share of training targets at horizon 1; the rest uniform
    min_train_steps: int = 1500  # small traces get more epochs, up to this many optimizer steps (8x at most)
    use_recall: bool = True  # the in-sequence recall input (`recall.py`); False is its ablation
    use_memory: bool = True  # the token memory input (`memory.py`); False is its ablation
    use_repeat: bool = True  # the recall of the token's earlier occurrences in its sequence; False is its ablation
    memory_rows: int = 512  # training rows the memory keeps per token
    num_members: int = 3  # independently initialised networks trained side by side; their logits are averaged
    num_recent_layers: int = 2  # latest known layers embedded again, apart from the prefix sum; 0 is its ablation
    UNIT_FIELDS: ClassVar[tuple[str, ...]] = ("dropout", "token_dropout", "next_layer_share")  # each in [0, 1]

    def channels(self) -> tuple[str, ...]:
        """The recall channels this model reads (`channels.py`), each turned on by its use_<name> flag."""
        return tuple(name for name in CHANNELS.names() if getattr(self, f"use_{name}"))

    def __post_init__(self):
        for name in ("hidden_dim", "min_token_count", "memory_rows", "num_members"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("min_train_steps", "num_recent_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in self.UNIT_FIELDS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1], got {getattr(self, name)}")


def summed_rows(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """[T, H]: the rows of table [R, H] named by each row of index [T, n], summed. One sparse product,
    so a whole trace never gathers a [T, n, H] array."""
    num_rows, n = index.shape
    starts = np.arange(0, num_rows * n + 1, n)
    picks = scipy.sparse.csr_matrix((np.ones(num_rows * n, dtype=table.dtype), index.ravel(), starts),
                                    shape=(num_rows, len(table)))
    return np.asarray(picks @ table)


def position_bucket(positions: np.ndarray) -> np.ndarray:
    """[N] log2 buckets of the position in the sequence: 0, 1, 2-3, 4-7, ..."""
    return np.minimum(np.log2(np.asarray(positions, dtype=np.float64) + 1).astype(np.int64), NUM_POSITION_BUCKETS - 1)


def token_keys(trace: Trace) -> tuple[list | None, str]:
    """The trace's token keys (strings, else ids) and which kind they are ("tokens", "token_ids", "")."""
    if trace.tokens is not None:
        return list(trace.tokens), "tokens"
    if trace.token_ids is not None:
        return trace.token_ids.tolist(), "token_ids"
    return None, ""


def build_vocabulary(keys: list | None, min_count: int) -> dict:
    """key -> index (1..V-1) of the keys seen at least min_count times; index 0 is the unknown token."""
    if keys is None:
        return {}
    values, counts = np.unique(np.asarray(keys, dtype=object).astype(str), return_counts=True)
    kept = values[counts >= min_count]
    return {str(key): index + 1 for index, key in enumerate(kept.tolist())}


def token_indices(keys, vocab: dict) -> np.ndarray:
    if keys is None:
        return np.zeros(0, dtype=np.int64)
    return np.fromiter((vocab.get(str(key), UNKNOWN) for key in keys), dtype=np.int64, count=len(keys))


def sequence_affinity(trace: Trace) -> np.ndarray:
    """[N, L, E] float16: per row, the share of the sequence's earlier tokens routed to each expert."""
    t = trace.topology
    out = np.zeros((trace.num_tokens, t.num_layers, t.num_experts), dtype=np.float16)
    for _, start, end in trace.sequence_bounds():
        hot = np.zeros((end - start, t.num_layers, t.num_experts), dtype=np.float32)
        np.put_along_axis(hot, trace.experts[start:end].astype(np.int64), 1.0, axis=2)
        counts = np.cumsum(hot, axis=0) - hot  # exclusive of the row itself
        seen = np.arange(end - start, dtype=np.float32)[:, None, None]
        out[start:end] = counts / np.maximum(seen, 1.0)
    return out


class RoutingWeights:
    """The model's arrays (numpy float32) and the numpy forward pass used online and for scoring."""

    NAMES = ("prefix", "gate", "token", "position", "previous", "target", "horizon", "norm_w", "norm_b",
             "out_w", "out_b", "skip")

    def __init__(self, arrays: dict[str, np.ndarray]):
        for name in self.NAMES:
            setattr(self, name, np.ascontiguousarray(arrays[name], dtype=np.float32))
        self.num_layers, self.num_experts, self.hidden_dim = self.prefix.shape
        self.num_members = int(np.asarray(arrays.get("num_members", 1)).reshape(-1)[0])  # blocks of hidden units
        self.uses_gate = bool(np.any(self.gate))
        self.hidden_in = np.asarray(arrays.get("hidden_in", np.zeros((0, 0, 0))), dtype=np.float32)  # [L, D, H2]
        hidden_out = np.asarray(arrays.get("hidden_out", np.zeros((0, 0, 0, 0))), dtype=np.float32)
        self.hidden_out = hidden_out[:, None] if hidden_out.ndim == 3 else hidden_out  # [L, D, H2, E], D distances
        self.uses_hidden = self.hidden_in.size > 0  # trained on a trace with router inputs
        no_recent = np.zeros((0,) + self.prefix.shape, dtype=np.float32)
        self.recent = np.asarray(arrays.get("recent", no_recent), dtype=np.float32)  # [R, L, E, H]
        present = [name for name in CHANNELS.names() if np.size(arrays.get(f"{name}_in", ())) > 0]  # older weights lack some
        self.channel_in = {name: np.asarray(arrays[f"{name}_in"], dtype=np.float32) for name in present}  # [L, E, H]
        self.channel_skip = {name: np.asarray(arrays[f"{name}_skip"], dtype=np.float32) for name in present}  # [L, E]
        self.memory = TokenMemory.from_arrays(arrays, self.num_experts)
        self.channels = tuple(present)

    def arrays(self) -> dict[str, np.ndarray]:
        channels = {f"{name}_in": w for name, w in self.channel_in.items()}
        channels |= {f"{name}_skip": w for name, w in self.channel_skip.items()}
        memory = self.memory.arrays() if self.memory is not None else {}
        own = {name: getattr(self, name) for name in self.NAMES + ("hidden_in", "hidden_out", "recent")}
        return own | {"num_members": np.array([self.num_members])} | channels | memory

    def latest(self, hidden: np.ndarray | None, layer: int) -> np.ndarray | None:
        """[T, H2]: the hidden path's activations from the router input [T, D] of `layer`, the latest routed."""
        if not self.uses_hidden or hidden is None:
            return None
        return np.maximum(unit_rms(hidden) @ self.hidden_in[layer], 0.0)

    def context(self, tokens: np.ndarray, buckets: np.ndarray, prev_experts: np.ndarray, has_prev: np.ndarray) -> np.ndarray:
        """[T, H] from token indices [T], position buckets [T], previous tokens' experts [T, L, K], has_prev [T]."""
        flat = prev_experts + (np.arange(self.num_layers) * self.num_experts)[None, :, None]  # [T, L, K]
        prev = summed_rows(self.previous, flat.reshape(len(tokens), -1)) * has_prev[:, None]  # [T, H]
        return self.token[tokens] + self.position[buckets] + prev

    def prefix_step(self, layer: int, experts: np.ndarray, gate_probs: np.ndarray | None) -> np.ndarray:
        """[T, H]: what layer's routing (experts [T, K], gate_probs [T, E] or None) adds to the prefix."""
        step = self.prefix[layer][experts].sum(axis=1)
        if self.uses_gate and gate_probs is not None:
            step = step + gate_probs @ self.gate[layer]
        return step

    def recent_step(self, cut: int, experts: np.ndarray) -> np.ndarray:
        """[T, H]: the latest known layers cut, cut-1, ... embedded again, from experts [T, L, K] (0 before any)."""
        out = np.zeros((len(experts), self.hidden_dim), dtype=np.float32)
        for i in range(min(len(self.recent), cut + 1)):
            out += expert_mask(experts[:, cut - i], self.num_experts).astype(np.float32) @ self.recent[i, cut - i]
        return out

    def logits(self, base: np.ndarray, targets: np.ndarray, horizons: np.ndarray, prev_hot: np.ndarray,
               affinity: np.ndarray, latest: np.ndarray | None = None, channels: dict | None = None) -> np.ndarray:
        """[T, n, E] for targets [n] at horizons [n]; base [T, H] = prefix + context;
        prev_hot, affinity and the recall channels (name -> [T, n, E]) at the target layers."""
        channels = channels or {}
        z = base[:, None, :] + self.target[targets][None] + self.horizon[np.minimum(horizons, len(self.horizon)) - 1][None]
        for name, x in channels.items():
            z = z + np.matmul(x.transpose(1, 0, 2), self.channel_in[name][targets]).transpose(1, 0, 2)  # [T, n, H]
        h = np.maximum(standardise(z, self.num_members) * self.norm_w + self.norm_b, 0.0)  # [T, n, H]
        out = np.matmul(h.transpose(1, 0, 2), self.out_w[targets]).transpose(1, 0, 2)  # [T, n, E]
        skip = self.skip[:, targets]  # [2, n, E]
        if latest is not None:
            distance = np.minimum(horizons, self.hidden_out.shape[1]) - 1
            out = out + np.matmul(latest, self.hidden_out[targets, distance]).transpose(1, 0, 2)  # [T, n, E]
        for name, x in channels.items():
            out = out + self.channel_skip[name][targets][None] * x
        return out + self.out_b[targets][None] + skip[0][None] * prev_hot + skip[1][None] * affinity


def standardise(z: np.ndarray, num_blocks: int) -> np.ndarray:
    """[..., H] with each of num_blocks equal blocks of the last axis at zero mean and unit variance."""
    shape = z.shape
    z = z.reshape(*shape[:-1], num_blocks, shape[-1] // num_blocks)
    z = z - z.mean(axis=-1, keepdims=True)
    return (z / np.sqrt((z * z).mean(axis=-1, keepdims=True) + 1e-5)).reshape(shape)


def join_members(members: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays of one model whose logits are the mean of the members' logits: the members' hidden
    units side by side (each block keeps its own layer norm), their readouts and per-expert terms averaged."""
    count, joined = len(members), {"num_members": np.array([len(members)])}
    for name in members[0]:
        parts = [member[name] for member in members]
        if name in PER_EXPERT or name.endswith("_skip"):
            joined[name] = np.mean(parts, axis=0)
        elif name in READOUTS:
            joined[name] = np.concatenate(parts, axis=READOUTS[name]) / count
        else:
            joined[name] = np.concatenate(parts, axis=-1)
    return joined


def unit_rms(x: np.ndarray) -> np.ndarray:
    """[..., D] float32 rows scaled to unit root-mean-square."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -30.0, 30.0)))

