"""Routing replay, for measurement only: the engine follows a recorded trace's routing instead of its
router's, so that a random-weight checkpoint meets the routing of a trained model.

Which rows: the trace is read as one token stream, in trace order. Each iteration takes the next
rows, one per token it processes (its active rows, batch-major, as the model flattens them); every
MoE layer of that iteration uses the same rows, at its own layer. Sequence boundaries of the trace
and of the prompts are not aligned (a prompt of 9 tokens may take the tail of one recorded prompt
and the head of the next): the point is real routing statistics, not a given prompt's routing.

Running out of rows wraps around to the first row (and is logged once): a benchmark's token count
is set by its prompts and flags, not by the trace, and wrapping keeps the recorded distribution
(the number of wraps is kept in `wraps`, so a report can say so). Each iteration's rows are kept in
`iterations` for a benchmark's simulator, the last MAX_RECORDED_ITERATIONS of them (a server that
replays for days stays bounded); `rows_used` counts every row. Steps run inside `paused()` follow the
router and take no rows (a measurement no request sees, such as serving's KV probe).

Experts: the trace's experts replace the router's top-k of the active rows; padding rows keep the
router's choice (they run no experts). Weights: the trace's gate weights when it has them, else the
router's own top-k weights in their order, so their scale and normalisation stay the model's; which
replayed expert gets which weight is then arbitrary, as the outputs under replay mean nothing. The
router's full distribution (gate probabilities for policies that ask) stays the model's own.

The replay is an observer (it learns each iteration's token count from `begin_iteration`) and the
experts forward asks it for each layer's routing (`moestream.runtime.experts.attach_replay`; an
iteration's rows of every layer go to the device once, at its first layer); it knows no policy and no
store.
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
        """Steps run inside follow the router's own routing and take no rows."""
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
        """Whether `iterations` still holds every iteration's rows."""
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
        """The iteration's active rows, and its trace rows' experts and weights of every layer, on the device."""
        weights = None if self._weights is None else upload(self._weights[rows], device)
        return (upload(np.flatnonzero(active), device), upload(self._experts[rows].astype(np.int64), device), weights)


def load_replay(path: str, model_topology: Topology) -> RoutingReplay:
    """The replay of a trace file (a moestream trace or a DeepSeek routing npz) for this model."""
    from moestream.trace.format import load_trace

    return RoutingReplay(load_trace(path), model_topology, str(path))
