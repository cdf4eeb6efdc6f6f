"""Token schedulers: how the running sequences are split into the batches that take turns to decode.

`fifo` keeps arrival order; `expertflow` (ExpertFlow's) puts sequences whose routing paths (one bit
per (layer, expert) their newest token chose) lie close in Hamming distance in one batch, by balanced
k-means, so each batch activates fewer distinct experts. `RoutingPaths` keeps those paths from the
engine's routing events and counts the distinct experts each decode iteration activates (a running
sum, so a server's long life keeps no per-iteration record). Schedulers see only paths and sizes.
"""

from __future__ import annotations

import math

import numpy as np

from moestream.contracts import Observer
from moestream.events import IterationContext, RoutingEvent
from moestream.registry import Registry
from moestream.topology import Topology

MAX_ROUNDS = 20


class TokenScheduler:
    """Splits sequences (rows of paths [N, L * E], bool) into groups of at most batch_size rows."""

    def group(self, paths: np.ndarray, batch_size: int) -> list[list[int]]:
        raise NotImplementedError


TOKEN_SCHEDULERS: Registry[TokenScheduler] = Registry("token scheduler")


@TOKEN_SCHEDULERS.register("fifo")
class FifoScheduler(TokenScheduler):
    """Consecutive runs of batch_size sequences in arrival order."""

    def group(self, paths: np.ndarray, batch_size: int) -> list[list[int]]:
        rows = list(range(len(paths)))
        return [rows[start: start + batch_size] for start in range(0, len(rows), batch_size)]


@TOKEN_SCHEDULERS.register("expertflow")
class ExpertFlowScheduler(TokenScheduler):
    """Balanced k-means in Hamming space, with k the fewest batches that hold every sequence."""

    def group(self, paths: np.ndarray, batch_size: int) -> list[list[int]]:
        num_groups = math.ceil(len(paths) / batch_size)
        if num_groups <= 1:
            return [list(range(len(paths)))] if len(paths) else []
        points = paths.astype(np.float32)  # [N, D]
        centroids = points[_farthest_first(points, num_groups)]  # [K, D]
        labels = None
        for _ in range(MAX_ROUNDS):
            new = _balanced_assign(_hamming(points, centroids), batch_size)
            if labels is not None and np.array_equal(new, labels):
                break
            labels = new
            centroids = np.stack([points[labels == k].mean(axis=0) for k in range(num_groups)])
        return [np.flatnonzero(labels == k).tolist() for k in range(num_groups)]


def _hamming(points: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """[N, K] expected Hamming distance of each 0/1 point to each (fractional) centroid."""
    return points @ (1 - centroids).T + (1 - points) @ centroids.T


def _farthest_first(points: np.ndarray, count: int) -> list[int]:
    """count seeds: row 0, then each time the row farthest from the seeds chosen (ties: lowest row)."""
    seeds = [0]
    nearest = _hamming(points, points[:1])[:, 0]  # [N]
    while len(seeds) < count:
        seeds.append(int(np.argmax(nearest)))
        nearest = np.minimum(nearest, _hamming(points, points[seeds[-1]: seeds[-1] + 1])[:, 0])
    return seeds


def _balanced_assign(distances: np.ndarray, capacity: int) -> np.ndarray:
    """Each point to its nearest centroid with room, the closest (point, centroid) pairs first."""
    num_points, num_groups = distances.shape
    labels = np.full(num_points, -1)
    room = np.full(num_groups, capacity)
    for flat in np.argsort(distances, axis=None, kind="stable"):
        point, group = divmod(int(flat), num_groups)
        if labels[point] < 0 and room[group] > 0:
            labels[point], room[group] = group, room[group] - 1
    return labels


class RoutingPaths(Observer):
    """Each running sequence's routing path (its newest token's experts at every MoE layer) and the
    distinct experts each decode iteration activated, from the engine's routing events."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.paths: dict[int, np.ndarray] = {}  # seq_id -> [L, E] bool
        self.num_decodes = 0  # decode iterations that activated experts
        self.num_activated = 0  # distinct (layer, expert) pairs of each of them, summed (bounded for a server's life)
        self._step: set[tuple[int, int]] | None = None

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._flush()
        self._step = None if ctx.is_prefill else set()

    def observe(self, event: RoutingEvent) -> None:
        seq_ids, last_from_end = np.unique(event.seq_ids[::-1], return_index=True)
        for seq_id, row in zip(seq_ids.tolist(), (len(event.seq_ids) - 1 - last_from_end).tolist()):
            path = self.paths.setdefault(seq_id, np.zeros((self.topology.num_layers, self.topology.num_experts), bool))
            path[event.layer] = False
            path[event.layer, event.expert_ids[row]] = True  # the sequence's newest token
        if self._step is not None:
            self._step.update((event.layer, int(e)) for e in event.experts())

    def end_sequence(self, seq_id: int) -> None:
        self.paths.pop(seq_id, None)

    def path(self, seq_id: int) -> np.ndarray:
        """[L * E] bool; all False before the sequence's first token has been routed."""
        shape = (self.topology.num_layers * self.topology.num_experts,)
        return self.paths[seq_id].reshape(-1) if seq_id in self.paths else np.zeros(shape, bool)

    def mean_activated(self) -> float:
        """Distinct experts a decode iteration activated, on average (0.0 before any)."""
        self._flush()
        return self.num_activated / self.num_decodes if self.num_decodes else 0.0

    def _flush(self) -> None:
        if self._step:
            self.num_decodes += 1
            self.num_activated += len(self._step)
        self._step = None
