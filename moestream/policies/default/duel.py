"""Set dueling for `default`: does its model beat recency on the routing this process sees?

`Duel`: two ghost caches of the device tier's size take every expert a layer routes, one evicting by
the model's expected next use (and taking the model's top-k of the next layer), the other the least
recently used; a ghost victim is never one of the layer's own experts. Over the last `window_tokens`
tokens' lookups, while LRU's ghost hits more, `DuelEviction` evicts LRU and `DuelPlanner` plans
nothing (docs/default-policy.md, "the duel"). It counts lookups, never time, so engine and simulator
switch alike. Knows routing events, the model's next uses and the tier's capacity, not the mechanism.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from moestream.events import RoutingEvent
from moestream.policies.contracts import CacheView, EvictionPolicy, Observer, Prediction, PrefetchPlanner, \
    TransferRequest
from moestream.policies.default.state import IterationState, compiled
from moestream.policies.eviction import NarrowingEviction
from moestream.topology import ExpertKey, Topology

NextUse = Callable[[], np.ndarray | None]  # [L, E] the model's next use of each expert (larger: later), or None
Ahead = Callable[[int], np.ndarray | None]  # layer c -> [E] the model's probabilities of layer c+1, or None


class Duel(Observer):
    """The two ghosts and the window's hits, as arrays that one compiled call per layer updates
    (kernels.duel_observe: the model ghost a mask, the LRU ghost a linked list, the window a ring)."""

    def __init__(self, topology: Topology, next_use: NextUse, ahead: Ahead, window_tokens: int):
        self.topology, self.next_use, self.ahead = topology, next_use, ahead
        self.capacity = 0  # the device tier's slots, once a plan has shown them (no duel before)
        L, E = topology.num_layers, topology.num_experts
        self._model = np.zeros(L * E, bool)  # [L*E] the model ghost's residents
        self._members = np.zeros(L * E, np.int64)  # [L*E] the model ghost's residents, the first `size` of it
        self._position = np.zeros(L * E, np.int64)  # [L*E] each resident's place in _members
        self._lru = np.full((2, L * E + 1), -1, np.int64)  # the LRU ghost: previous and next of each, sentinel L*E
        self._lru[:, -1] = L * E
        self._ghost = np.zeros(7, np.int64)  # kernels' counters: capacity, sizes, hits, lookups kept, next slot
        self._outcomes = np.zeros(window_tokens * L * topology.top_k, np.uint8)  # per lookup: model hit | lru hit << 1
        self._no_table, self._no_probs = np.zeros((L, E)), np.zeros(0, np.float32)
        self.recency = False  # whether recency leads now

    def see_capacity(self, capacity: int) -> None:
        self.capacity = capacity

    def observe(self, event: RoutingEvent) -> None:
        if self.capacity < 1:
            return
        layer, table = event.layer, self.next_use()
        probs = self.ahead(layer) if layer + 1 < self.topology.num_layers else None  # the model's next layer
        self._ghost[0] = self.capacity
        self.recency = bool(compiled().duel_observe(
            self._model, self._members, self._position, self._no_table if table is None else table, layer,
            np.ascontiguousarray(event.expert_ids, np.int64), self._no_probs if probs is None else probs,
            self.topology.top_k, self._lru, self._ghost, self._outcomes))


def warm_up(topology: Topology, state: IterationState) -> None:
    """Runs a layer through a throwaway duel on the state's arrays, so that numba compiles (or loads from
    its cache) the duel's kernel for the types a policy passes when it loads, not at the first request."""
    duel = Duel(topology, lambda: state.next_use, lambda layer: state.scores(layer, layer + 1), 1)
    duel.see_capacity(1)
    rows = np.zeros(1, np.int64)
    duel.observe(RoutingEvent(0, np.arange(topology.top_k)[None], rows, rows))


class DuelEviction(NarrowingEviction):
    """The model's eviction (the inner one, which sees every hook) while the model leads the duel, LRU's
    while recency does (it keeps the residents' recency from the same hooks, least recent first)."""

    def __init__(self, model: EvictionPolicy, duel: Duel):
        super().__init__(model)
        self.duel = duel
        self._recent: OrderedDict[ExpertKey, None] = OrderedDict()

    def on_insert(self, key: ExpertKey) -> None:
        self.inner.on_insert(key)
        self._recent[key] = None
        self._recent.move_to_end(key)

    def on_access(self, key: ExpertKey) -> None:
        self.inner.on_access(key)
        self._recent[key] = None
        self._recent.move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        self.inner.on_remove(key)
        self._recent.pop(key, None)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        if not self.duel.recency:
            return self.inner.victim(candidates)
        for key in self._recent:  # as LRUPolicy: the least recent candidate
            if key in candidates:
                return key
        return candidates[0]


class DuelPlanner(PrefetchPlanner):
    """The model's planner while the model leads the duel; no speculative reads while recency does. Shows
    the duel the tier's capacity."""

    def __init__(self, inner: PrefetchPlanner, duel: Duel):
        self.inner, self.duel = inner, duel

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        self.duel.see_capacity(view.capacity)
        return [] if self.duel.recency else self.inner.plan(predictions, view)
