"""Eviction policies that need nothing but the accesses they see."""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from typing import Sequence

from moestream.policies.base import EVICTIONS, EvictionPolicy
from moestream.topology import ExpertKey


@EVICTIONS.register("lru")
class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted or accessed expert."""

    def __init__(self):
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_access(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        # tests membership key by key: the cache's candidates answer `in` in O(1)
        for key in self._order:
            if key in candidates:
                return key
        return candidates[0]

    def _touch(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)


@EVICTIONS.register("lfu")
class LFUPolicy(EvictionPolicy):
    """Evicts the expert accessed least often over the whole run; ties go to the least recent.

    A heap of (count, last touch, key) with stale entries skipped keeps a victim O(log n).
    """

    def __init__(self):
        self._counts: Counter[ExpertKey] = Counter()
        self._touched: dict[ExpertKey, int] = {}  # resident key -> its last insert or access
        self._clock = 0
        self._heap: list[tuple[int, int, ExpertKey]] = []

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_access(self, key: ExpertKey) -> None:
        self._counts[key] += 1
        self._touch(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._touched.pop(key, None)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        heap, kept, victim = self._heap, [], None
        while heap:
            entry = heapq.heappop(heap)
            if self._touched.get(entry[2]) != entry[1]:
                continue  # stale: touched again or removed since
            kept.append(entry)
            if entry[2] in candidates:
                victim = entry[2]
                break
        for entry in kept:
            heapq.heappush(heap, entry)
        if victim is None:
            victim = min(candidates, key=lambda k: (self._counts[k], self._touched.get(k, -1)))
        return victim

    def _touch(self, key: ExpertKey) -> None:
        self._clock += 1
        self._touched[key] = self._clock
        heapq.heappush(self._heap, (self._counts[key], self._clock, key))
        if len(self._heap) > 4 * len(self._touched) + 64:
            self._heap = [(self._counts[k], t, k) for k, t in self._touched.items()]
            heapq.heapify(self._heap)
