"""Set dueling for `default`: does its model beat recency on the routing this process sees?

`Duel`: two ghost caches of the device tier's size take every expert a layer routes, one evicting by
the model's expected next use (and taking the model's top-k of the next layer), the other the least
recently used; a ghost victim is never one of the layer's own experts. Over the last `window_tokens`
tokens' lookups, while LRU's ghost hits more, `DuelEviction` evicts LRU and `DuelPlanner` plans
nothing (docs/default-policy.md, "the duel"). It counts lookups, never time, so engine and simulator
switch alike. Knows routing events, the model's next uses and the tier's capacity, not the mechanism.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Sequence

import numpy as np

from moestream.events import RoutingEvent
from moestream.policies.contracts import CacheView, EvictionPolicy, Observer, Prediction, PrefetchPlanner, \
    TransferRequest
from moestream.policies.eviction import LRUPolicy, NarrowingEviction
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
        self._model_hits = self._lru_hits = 0  # over the window
        self.recency = False  # whether recency leads now

    def see_capacity(self, capacity: int) -> None:
        self.capacity = capacity

    def observe(self, event: RoutingEvent) -> None:
        if self.capacity < 1:
            return
        layer, experts = event.layer, event.experts().tolist()
        table = self.next_use()
        table = np.zeros(self._model.shape) if table is None else table
        waits = np.where(self._model, table, -np.inf)  # [L, E] the model ghost's candidate victims
        waits[layer, experts] = -np.inf  # never one of the layer's own experts
        for expert in experts:
            hit = self._take_model(layer, expert, waits, -np.inf)
            self._count((hit, self._look_lru(ExpertKey(layer, expert))))
        for expert in self._expected(layer):
            self._take_model(layer + 1, expert, waits, table[layer + 1, expert])
        self.recency = len(self._outcomes) == self._outcomes.maxlen and self._lru_hits > self._model_hits

    def _count(self, outcome: tuple[bool, bool]) -> None:
        if len(self._outcomes) == self._outcomes.maxlen:
            model, lru = self._outcomes[0]
            self._model_hits, self._lru_hits = self._model_hits - model, self._lru_hits - lru
        self._outcomes.append(outcome)
        self._model_hits, self._lru_hits = self._model_hits + outcome[0], self._lru_hits + outcome[1]

    def _look_lru(self, key: ExpertKey) -> bool:
        hit = key in self._lru
        self._lru[key] = None
        self._lru.move_to_end(key)
        if len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return hit

    def _take_model(self, layer: int, expert: int, waits: np.ndarray, wait: float) -> bool:
        """Whether the model ghost held the expert; it holds it now (wait: its rank as a victim), evicting the
        candidate with the latest next use (the smaller key on a tie), unless no candidate is left."""
        if self._model[layer, expert]:
            return True
        if self._model_size >= self.capacity:
            index = int(waits.argmax())
            if waits.flat[index] == -np.inf:
                return False
            self._model.flat[index], waits.flat[index] = False, -np.inf
            self._model_size -= 1
        self._model[layer, expert], waits[layer, expert] = True, wait
        self._model_size += 1
        return False

    def _expected(self, layer: int) -> list[int]:
        """The top_k experts the model expects at the next layer (none past the last)."""
        probs = self.ahead(layer) if layer + 1 < self.topology.num_layers else None
        return [] if probs is None else np.argsort(-probs, kind="stable")[: self.topology.top_k].tolist()


class DuelEviction(NarrowingEviction):
    """The model's eviction (the inner one, which sees every hook) while the model leads the duel, LRU's
    while recency does (it sees the residency hooks too)."""

    def __init__(self, model: EvictionPolicy, duel: Duel):
        super().__init__(model)
        self.lru, self.duel = LRUPolicy(), duel

    def on_insert(self, key: ExpertKey) -> None:
        super().on_insert(key)
        self.lru.on_insert(key)

    def on_access(self, key: ExpertKey) -> None:
        super().on_access(key)
        self.lru.on_access(key)

    def on_remove(self, key: ExpertKey) -> None:
        super().on_remove(key)
        self.lru.on_remove(key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        return (self.lru if self.duel.recency else self.inner).victim(candidates)


class DuelPlanner(PrefetchPlanner):
    """The model's planner while the model leads the duel; no speculative reads while recency does. Shows
    the duel the tier's capacity."""

    def __init__(self, inner: PrefetchPlanner, duel: Duel):
        self.inner, self.duel = inner, duel

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        self.duel.see_capacity(view.capacity)
        return [] if self.duel.recency else self.inner.plan(predictions, view)
