"""Routing replay, for measurement only: the engine follows a recorded trace's routing instead of its
router's, so that a random-weight checkpoint meets the routing of a trained model.

The trace is read as one token stream: each iteration takes the next rows, one per active token
(batch-major), the same rows at every MoE layer; trace and prompt boundaries are not aligned (the point
is real routing statistics). Running out wraps to the first row (counted in `wraps`, logged once). The
last MAX_RECORDED_ITERATIONS iterations' rows are kept in `iterations` for a benchmark's simulator;
`rows_used` counts every row. Steps inside `paused()` follow the router and take no rows.

The trace's experts replace the router's top-k of active rows (padding keeps the router's); weights are
the trace's gate weights, else the router's own top-k weights in their order (the outputs under replay
mean nothing). Gate probabilities stay the model's. The replay is an observer (`begin_iteration` gives
the token count) that the experts forward asks for each layer's routing; it knows no policy and no store.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque

import numpy as np
import torch

from moestream.contracts import Observer
from moestream.errors import MoestreamError
from moestream.events import IterationContext
from moestream.runtime.host_reads import upload
from moestream.topology import Topology
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

REPLAY_LABEL = "replayed routing"  # printed beside figures measured under replay
MAX_RECORDED_ITERATIONS = 65536  # a benchmark's runs take a few hundred


class ReplayError(MoestreamError):
    """A trace that cannot drive this model's routing."""


def check_topology(trace: Trace, model: Topology, path: str = "trace") -> None:
    """The routing shape (MoE layers, experts per layer, top_k) must match; expert sizes may differ."""
    ours, theirs = model, trace.topology
    if not ours.routes_like(theirs):
        raise ReplayError(
            f"cannot replay {path}: it routes {theirs.routing_shape()}; the model has {ours.routing_shape()}")
    if not trace.num_tokens:
        raise ReplayError(f"cannot replay {path}: it has no tokens")


class RoutingReplay(Observer):
    """Hands each iteration the next rows of the trace and substitutes their experts for the router's."""

    def __init__(self, trace: Trace, model_topology: Topology, source: str = "trace"):
        check_topology(trace, model_topology, source)
        self.num_rows = trace.num_tokens
        self.source = source
        self.cursor = 0  # the next trace row
        self.wraps = 0  # times the cursor went past the last row
        self.iterations: deque[np.ndarray] = deque(maxlen=MAX_RECORDED_ITERATIONS)  # [T] rows of each iteration
        self.rows_used = 0  # rows fed to every iteration so far
        small = np.uint8 if model_topology.num_experts <= 256 else trace.experts.dtype
        self._experts = trace.experts.astype(small, copy=False)  # [N, L, K]; the rest of the trace is not kept
        self._weights = trace.gate_weights  # [N, L, K] or None
        self._paused = False
        self._uploaded: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # this iteration's

    @contextlib.contextmanager
    def paused(self):
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @property
    def is_paused(self) -> bool:
        return self._paused

    def begin_iteration(self, ctx: IterationContext) -> None:
        if self._paused:
            return
        n = self.num_rows
        rows = (self.cursor + np.arange(ctx.num_tokens)) % n  # [T]
        wraps = (self.cursor + ctx.num_tokens) // n
        if wraps and not self.wraps:
            log.info("routing replay wrapped around %s after %d rows", self.source, n)
        self.wraps += wraps
        self.cursor = (self.cursor + ctx.num_tokens) % n
        self.iterations.append(rows)
        self.rows_used += len(rows)
        self._uploaded = None  # uploaded at the iteration's first layer, once for all its layers

    @property
    def recorded_all(self) -> bool:
        return sum(len(rows) for rows in self.iterations) == self.rows_used

    def route(self, layer: int, active: np.ndarray, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """active [T] bool, top_k_index/top_k_weights [T, K] -> the replayed [T, K] pair."""
        if self._paused:
            return top_k_index, top_k_weights
        if not self.iterations:
            raise RuntimeError("routing replay got a layer before any iteration began")
        if self._uploaded is None:
            self._uploaded = self._upload(self.iterations[-1], active, top_k_index.device)
        picked, experts, weights = self._uploaded  # [A], [A, L, K], [A, L, K] or None
        if len(picked) != len(self.iterations[-1]):
            raise RuntimeError(f"the iteration announced {len(self.iterations[-1])} tokens but layer {layer} runs "
                               f"{len(picked)}")
        index = top_k_index.clone()
        index[picked] = experts[:, layer].to(index.dtype)
        if weights is None:
            return index, top_k_weights
        replayed = top_k_weights.clone()
        replayed[picked] = weights[:, layer].to(replayed.dtype)  # [A, K]
        return index, replayed

    def _upload(self, rows: np.ndarray, active: np.ndarray, device: torch.device):
        weights = None if self._weights is None else upload(self._weights[rows], device)
        return (upload(np.flatnonzero(active), device), upload(self._experts[rows].astype(np.int64), device), weights)


def load_replay(path: str, model_topology: Topology) -> RoutingReplay:
    from moestream.trace.format import load_trace

    return RoutingReplay(load_trace(path), model_topology, str(path))
