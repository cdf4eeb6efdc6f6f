"""Set dueling for `default`: does its model beat recency on the routing this process sees?

Two ghost caches of the device tier's size take every expert a layer routes, one evicting by the model's
expected next use (and taking the model's top-k of the next layer), the other LRU. While LRU's ghost hits
more over the last `window_tokens` tokens' lookups, `DuelEviction` evicts LRU and `DuelPlanner` plans
nothing (docs/default-policy.md, "the duel"). It counts lookups, never time, so engine and simulator
switch alike. Knows routing events, the model's next uses and the tier's capacity, not the mechanism.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from moestream.contracts import CacheView, EvictionPolicy, Observer, Prediction, PrefetchPlanner, TransferRequest
from moestream.events import RoutingEvent
from moestream.policies.default.state import IterationState, compiled
from moestream.policies.eviction import LRUPolicy, NarrowingEviction, forwarded
from moestream.topology import ExpertKey, Topology

NextUse = Callable[[], np.ndarray | None]  # [L, E] the model's next use of each expert (larger: later), or None
Ahead = Callable[[int], np.ndarray | None]  # layer c -> [E] the model's probabilities of layer c+1, or None


class Duel(Observer):
    """The two ghosts and the window's hits as arrays, which one compiled call a layer updates."""

    def __init__(self, topology: Topology, next_use: NextUse, ahead: Ahead, window_tokens: int):
        self.topology, self.next_use, self.ahead = topology, next_use, ahead
        self.capacity = 0  # the device tier's slots, once a plan has shown them (no duel before)
        L, E = topology.num_layers, topology.num_experts
        self._ghosts = np.zeros((6, max(L * E + 1, 8)), np.int64)  # the rows kernels.duel_observe names
        self._ghosts[:2] = -1  # the LRU ghost: none held, the sentinel its own neighbour
        self._ghosts[:2, L * E] = L * E
        self._ghosts[5, 7] = topology.top_k  # counters (kernels.COUNTS): TOP_K
        self._outcomes = np.zeros(window_tokens * L * topology.top_k, np.uint8)  # per lookup: model hit | lru hit << 1
        self._no_table, self._no_probs = np.zeros((L, E)), np.zeros(0, np.float32)
        self._num_layers = L
        self.recency = False  # whether recency leads now

    def see_capacity(self, capacity: int) -> None:
        self.capacity = capacity

    def observe(self, event: RoutingEvent) -> None:
        if self.capacity < 1:
            return
        layer, table = event.layer, self.next_use()
        probs = self.ahead(layer) if layer + 1 < self._num_layers else None  # the model's next layer
        self._ghosts[5, 0] = self.capacity  # counters (kernels.COUNTS): CAPACITY
        self.recency = bool(compiled().duel_observe(
            self._ghosts, self._outcomes, self._no_table if table is None else np.ascontiguousarray(table, np.float64),
            layer, np.ascontiguousarray(event.expert_ids, np.int64), self._no_probs if probs is None else probs))


def warm_up(topology: Topology, state: IterationState) -> None:
    """Runs a layer through a throwaway duel, so that numba compiles its kernel when a policy loads."""
    duel = Duel(topology, lambda: state.next_use, lambda layer: state.scores(layer, layer + 1), 1)
    duel.see_capacity(1)
    rows = np.zeros(1, np.int64)
    duel.observe(RoutingEvent(0, np.arange(topology.top_k)[None], rows, rows))


class DuelEviction(NarrowingEviction):
    """The model's eviction (the inner one, which sees every hook) while the model leads the duel, LRU's
    (fed the same hooks) while recency does."""

    def __init__(self, model: EvictionPolicy, duel: Duel):
        super().__init__(model)
        self.duel, self.lru = duel, LRUPolicy()

    on_insert = forwarded("on_insert", "inner", "lru")
    on_access = forwarded("on_access", "inner", "lru")
    on_remove = forwarded("on_remove", "inner", "lru")

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        return (self.lru if self.duel.recency else self.inner).victim(candidates)


class DuelPlanner(PrefetchPlanner):
    """The model's planner while it leads the duel, none while recency does; shows the duel the capacity."""

    def __init__(self, inner: PrefetchPlanner, duel: Duel):
        self.inner, self.duel = inner, duel

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        self.duel.see_capacity(view.capacity)
        return [] if self.duel.recency else self.inner.plan(predictions, view)
