"""Eviction policies that need nothing but the accesses they see."""

from __future__ import annotations

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
        allowed = set(candidates)
        for key in self._order:
            if key in allowed:
                return key
        return candidates[0]

    def _touch(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)


@EVICTIONS.register("lfu")
class LFUPolicy(EvictionPolicy):
    """Evicts the expert accessed least often over the whole run; ties go to the least recent."""

    def __init__(self):
        self._counts: Counter[ExpertKey] = Counter()
        self._recency = LRUPolicy()

    def on_insert(self, key: ExpertKey) -> None:
        self._recency.on_insert(key)

    def on_access(self, key: ExpertKey) -> None:
        self._counts[key] += 1
        self._recency.on_access(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._recency.on_remove(key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        fewest = min(self._counts[key] for key in candidates)
        return self._recency.victim([key for key in candidates if self._counts[key] == fewest])
