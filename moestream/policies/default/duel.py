"""Set dueling for `default`: does its model beat recency on the routing this process sees?

The trained model is fitted to one model's routing; served elsewhere (another checkpoint, a random
router, a workload unlike the training trace) its probabilities can mislead both its eviction and
its prefetch, and then on-demand LRU does better. `Duel` finds out from the routing alone. Two ghost
caches of the device tier's size take every expert a layer routes, as the layers are published: one
evicts by the model's expected next use (the same table `DefaultEviction` ranks), the other the
least recently used; a ghost victim is never one of the layer's own experts. Over the last
`window_tokens` tokens' lookups the ghost with more hits wins. While recency wins, `default` acts
as on-demand LRU: `DuelEviction` evicts the least recently used and `DuelPlanner` plans no
speculative reads; it returns to its model as soon as the model's ghost wins again. The ghosts
leave prefetch out, so the model is judged on its ranking alone. Deterministic: it counts lookups,
never time, so engine and simulator see the same switches. Knows routing events, the model's
table of next uses and the planner's view of the tier's capacity, not the mechanism.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Sequence

import numpy as np

from moestream.events import IterationContext, RoutingEvent
from moestream.policies.contracts import CacheView, EvictionPolicy, Observer, Prediction, PrefetchPlanner, \
    TransferRequest
from moestream.policies.eviction import LRUPolicy
from moestream.topology import ExpertKey, Topology

NextUse = Callable[[], np.ndarray | None]  # [L, E] the model's next use of each expert (larger: later), or None
Ahead = Callable[[int], np.ndarray | None]  # layer c -> [E] the model's probabilities of layer c+1, or None


class Duel(Observer):
    def __init__(self, topology: Topology, next_use: NextUse, ahead: Ahead, window_tokens: int):
        self.topology, self.next_use, self.ahead = topology, next_use, ahead
        self.capacity = 0  # the device tier's slots, once a plan has shown them (no duel before)
        window = window_tokens * topology.num_layers * topology.top_k
        self._lru: OrderedDict[ExpertKey, None] = OrderedDict()
        self._model = np.zeros((topology.num_layers, topology.num_experts), bool)  # [L, E] the model ghost's residents
        self._model_size = 0
        self._outcomes: deque[tuple[bool, bool]] = deque(maxlen=window)  # (model hit, lru hit) per lookup
        self._hits = np.zeros(2, np.int64)  # model, lru: over the window
        self.recency = False  # whether recency leads now

    def see_capacity(self, capacity: int) -> None:
        self.capacity = capacity

    def observe(self, event: RoutingEvent) -> None:
        if self.capacity < 1:
            return
        layer, experts = event.layer, event.experts().tolist()
        protected = np.zeros(self.topology.num_experts, bool)
        protected[experts] = True
        for expert in experts:
            outcome = (self._look_model(layer, expert, protected), self._look_lru(ExpertKey(layer, expert)))
            self._count(outcome)
        self._prefetch_model(layer, protected)
        self.recency = len(self._outcomes) == self._outcomes.maxlen and self._hits[1] > self._hits[0]

    def _count(self, outcome: tuple[bool, bool]) -> None:
        if len(self._outcomes) == self._outcomes.maxlen:
            self._hits -= self._outcomes[0]
        self._outcomes.append(outcome)
        self._hits += outcome

    def _look_lru(self, key: ExpertKey) -> bool:
        hit = key in self._lru
        self._lru[key] = None
        self._lru.move_to_end(key)
        if len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return hit

    def _look_model(self, layer: int, expert: int, protected: np.ndarray) -> bool:
        if self._model[layer, expert]:
            return True
        if self._model_size >= self.capacity:
            self._evict_model(layer, protected)
        if self._model_size < self.capacity:
            self._model[layer, expert] = True
            self._model_size += 1
        return False

    def _prefetch_model(self, layer: int, protected: np.ndarray) -> None:
        """The model ghost takes the top_k experts the model expects at the next layer."""
        probs = self.ahead(layer)
        if probs is None or layer + 1 >= self.topology.num_layers:
            return
        for expert in np.argsort(-probs, kind="stable")[: self.topology.top_k].tolist():
            if not self._model[layer + 1, expert]:
                if self._model_size >= self.capacity:
                    self._evict_model(layer, protected)
                if self._model_size < self.capacity:
                    self._model[layer + 1, expert] = True
                    self._model_size += 1

    def _evict_model(self, layer: int, protected: np.ndarray) -> None:
        """The model ghost's victim: the resident with the latest next use (the smaller key on a tie)."""
        table = self.next_use()
        wait = np.where(self._model, 0.0 if table is None else table, -np.inf)  # [L, E]
        wait[layer, protected] = -np.inf
        index = int(wait.argmax())
        if wait.flat[index] > -np.inf:
            self._model.flat[index] = False
            self._model_size -= 1


class DuelEviction(EvictionPolicy):
    """The model's eviction while the model leads the duel, LRU's while recency does (both see every hook)."""

    def __init__(self, model: EvictionPolicy, duel: Duel):
        self.model, self.lru, self.duel = model, LRUPolicy(), duel

    def on_insert(self, key: ExpertKey) -> None:
        self.model.on_insert(key)
        self.lru.on_insert(key)

    def on_access(self, key: ExpertKey) -> None:
        self.model.on_access(key)
        self.lru.on_access(key)

    def on_remove(self, key: ExpertKey) -> None:
        self.model.on_remove(key)
        self.lru.on_remove(key)

    def begin_iteration(self, ctx: IterationContext) -> None:
        self.model.begin_iteration(ctx)

    def observe(self, event: RoutingEvent) -> None:
        self.model.observe(event)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        return (self.lru if self.duel.recency else self.model).victim(candidates)


class DuelPlanner(PrefetchPlanner):
    """The model's planner while the model leads the duel; no speculative reads while recency does. Shows
    the duel the tier's capacity."""

    def __init__(self, inner: PrefetchPlanner, duel: Duel):
        self.inner, self.duel = inner, duel

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        self.duel.see_capacity(view.capacity)
        return [] if self.duel.recency else self.inner.plan(predictions, view)
