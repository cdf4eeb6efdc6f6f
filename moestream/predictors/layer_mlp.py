"""ProMoE's learned sliding-window predictors: for each target MoE layer i and distance k, a two-layer
MLP that maps what is known at layer i-k to the experts of layer i, trained with binary
cross-entropy on recorded traces.

Two input kinds: `hidden` (the router's input at layer i-k, as ProMoE uses) and `routing` (the
multi-hot experts of layers i-k-w+1 .. i-k, for traces that recorded routing only). It knows traces
and tensors; nothing about caches, planners or the engine.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from moestream.errors import TraceError
from moestream.predictors.configs import TrainConfig
from moestream.predictors.training import multi_hot, seeded, train_loop
from moestream.trace.schema import Trace


class HiddenFeatures:
    """The router's input (trace field `hidden`) at each layer."""

    kind = "hidden"

    def in_features(self, trace: Trace) -> int:
        if trace.hidden is None:
            raise TraceError(
                f"trace {trace.source or '(unnamed)'} has no 'hidden' field (router inputs); record one with "
                "the engine's --record-trace, or use the routing-only variant promoe-routing"
            )
        return int(trace.hidden.shape[-1])

    def rows(self, trace: Trace, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(trace.hidden[rows].astype(np.float32))  # [B, L, H]


class RoutingFeatures:
    """The multi-hot experts of a window of `window_layers` layers ending at each layer."""

    kind = "routing"

    def __init__(self, window_layers: int):
        self.window_layers = window_layers

    def in_features(self, trace: Trace) -> int:
        return self.window_layers * trace.topology.num_experts

    def rows(self, trace: Trace, rows: np.ndarray) -> torch.Tensor:
        return routing_windows(multi_hot(trace.experts[rows], trace.topology.num_experts), self.window_layers)


Features = HiddenFeatures | RoutingFeatures  # in_features(trace) -> I; rows(trace, rows) -> [B, L, I]


def routing_windows(hot: torch.Tensor, window: int) -> torch.Tensor:
    """[B, L, E] multi-hot -> [B, L, W*E]: layers l-W+1 .. l side by side (oldest first, zeros before 0)."""
    num_layers = hot.shape[1]
    padded = torch.cat([hot.new_zeros(hot.shape[0], window - 1, hot.shape[2]), hot], dim=1)  # [B, L+W-1, E]
    return torch.cat([padded[:, j : j + num_layers] for j in range(window)], dim=-1)  # [B, L, W*E]


class LayerMLPs(nn.Module):
    """M independent two-layer MLPs applied side by side: [B, M, I] -> [B, M, O]."""

    def __init__(self, num_mlps: int, in_features: int, hidden_units: int, out_features: int):
        super().__init__()
        self.w1 = nn.Parameter(_uniform((num_mlps, in_features, hidden_units), in_features))
        self.b1 = nn.Parameter(_uniform((num_mlps, hidden_units), in_features))
        self.w2 = nn.Parameter(_uniform((num_mlps, hidden_units, out_features), hidden_units))
        self.b2 = nn.Parameter(_uniform((num_mlps, out_features), hidden_units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.einsum("bmi,mih->bmh", x, self.w1) + self.b1)  # [B, M, Hd]
        return torch.einsum("bmh,mho->bmo", h, self.w2) + self.b2  # [B, M, O]

    def one(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """MLP number index on x [T, I] -> [T, O]."""
        h = torch.relu(x @ self.w1[index] + self.b1[index])  # [T, Hd]
        return h @ self.w2[index] + self.b2[index]  # [T, O]


def _uniform(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound)


class SlidingWindowNet(nn.Module):
    """mlps[k-1] holds the MLPs of distance k; its MLP m maps source layer m to target layer m+k."""

    def __init__(self, num_layers: int, num_experts: int, in_features: int, hidden_units: int, num_distances: int):
        super().__init__()
        self.num_layers, self.num_distances = num_layers, num_distances
        self.mlps = nn.ModuleList(
            LayerMLPs(num_layers - k, in_features, hidden_units, num_experts) for k in range(1, num_distances + 1)
        )
        self.register_buffer("in_mean", torch.zeros(num_layers, in_features))  # [L, I]
        self.register_buffer("in_std", torch.ones(num_layers, in_features))  # [L, I]

    def forward(self, feats: torch.Tensor) -> list[torch.Tensor]:
        """[B, L, I] inputs of every layer -> for k = 1..D, [B, L-k, E] logits of layers k..L-1."""
        x = (feats - self.in_mean) / self.in_std  # [B, L, I]
        return [mlp(x[:, : self.num_layers - k]) for k, mlp in enumerate(self.mlps, start=1)]

    def logits(self, x: torch.Tensor, source_layer: int, distance: int) -> torch.Tensor:
        """[T, I] input of source_layer -> [T, E] logits of layer source_layer + distance."""
        x = (x - self.in_mean[source_layer]) / self.in_std[source_layer]
        return self.mlps[distance - 1].one(x, source_layer)


def fit_sliding_window(
    trace: Trace, features: Features, hidden_units: int, num_distances: int, standardize: bool, train: TrainConfig
) -> tuple[SlidingWindowNet, list[float]]:
    """Trains the MLPs of distances 1..num_distances (at most L-1) on every token of trace."""
    topology = trace.topology
    in_features = features.in_features(trace)
    if trace.num_tokens == 0:
        raise TraceError("cannot train sliding-window predictors on an empty trace")
    distances = min(num_distances, topology.num_layers - 1)
    if distances < 1:
        raise TraceError("sliding-window predictors need at least two MoE layers")
    loss_fn = nn.BCEWithLogitsLoss()
    with seeded(train.seed, train.num_threads):
        net = SlidingWindowNet(topology.num_layers, topology.num_experts, in_features, hidden_units, distances)
        if standardize:
            _set_standardization(net, trace, features)

        def batch_loss(rows: np.ndarray) -> torch.Tensor:
            target = multi_hot(trace.experts[rows], topology.num_experts)  # [B, L, E]
            outs = net(features.rows(trace, rows))
            return sum(loss_fn(out, target[:, k:]) for k, out in enumerate(outs, start=1)) / len(outs)

        losses = train_loop(net, batch_loss, trace.num_tokens, train, desc=f"sliding-window MLPs ({features.kind})")
    return net, losses


def _set_standardization(net: SlidingWindowNet, trace: Trace, features: Features, chunk: int = 4096) -> None:
    total = torch.zeros_like(net.in_mean, dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, trace.num_tokens, chunk):
        x = features.rows(trace, np.arange(start, min(start + chunk, trace.num_tokens))).double()  # [B, L, I]
        total += x.sum(0)
        squares += (x * x).sum(0)
    mean = total / trace.num_tokens
    std = (squares / trace.num_tokens - mean * mean).clamp_min(0.0).sqrt()
    net.in_mean.copy_(mean.float())
    net.in_std.copy_(std.float().clamp_min(1e-3))
