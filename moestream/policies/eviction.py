"""Eviction policies that need nothing but the accesses they see."""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from typing import Any, Sequence

from moestream.contracts import EVICTIONS, EvictionPolicy
from moestream.events import IterationContext, RoutingEvent
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


class NarrowingEviction(EvictionPolicy):
    """Passes every hook to an inner policy; a subclass changes one decision (e.g. narrows the candidates the
    inner one chooses from, or which policy chooses)."""

    def __init__(self, inner: EvictionPolicy):
        self.inner = inner

    def on_insert(self, key: ExpertKey) -> None:
        self.inner.on_insert(key)

    def on_access(self, key: ExpertKey) -> None:
        self.inner.on_access(key)

    def on_remove(self, key: ExpertKey) -> None:
        self.inner.on_remove(key)

    def begin_iteration(self, ctx: IterationContext) -> None:
        self.inner.begin_iteration(ctx)

    def observe(self, event: RoutingEvent) -> None:
        self.inner.observe(event)

    def end_sequence(self, seq_id: int) -> None:
        self.inner.end_sequence(seq_id)


class PriorityIndex:
    """Keys with a priority each, smallest first: a heap whose stale entries (a key given a new
    priority, or discarded) are skipped when met, and dropped when they outnumber the live ones."""

    def __init__(self):
        self._heap: list[tuple[Any, ExpertKey]] = []
        self._current: dict[ExpertKey, Any] = {}

    def set(self, key: ExpertKey, priority) -> None:
        self._current[key] = priority
        heapq.heappush(self._heap, (priority, key))
        if len(self._heap) > 4 * len(self._current) + 64:
            self._heap = [(value, k) for k, value in self._current.items()]
            heapq.heapify(self._heap)

    def discard(self, key: ExpertKey) -> None:
        self._current.pop(key, None)

    def get(self, key: ExpertKey, default=None):
        return self._current.get(key, default)

    def first_in(self, candidates: Sequence[ExpertKey]) -> ExpertKey | None:
        """The live key of smallest priority among candidates (None if no candidate is indexed)."""
        heap, kept, found = self._heap, [], None
        while heap:
            entry = heapq.heappop(heap)
            if self._current.get(entry[1]) != entry[0]:
                continue  # stale
            kept.append(entry)
            if entry[1] in candidates:
                found = entry[1]
                break
        for entry in kept:
            heapq.heappush(heap, entry)
        return found


@EVICTIONS.register("lfu")
class LFUPolicy(EvictionPolicy):
    """Evicts the expert accessed least often over the whole run; ties go to the least recent.

    A PriorityIndex of (count, last touch) keeps a victim O(log n).
    """

    def __init__(self):
        self._counts: Counter[ExpertKey] = Counter()
        self._clock = 0
        self._index = PriorityIndex()  # resident key -> (count, last insert or access)

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_access(self, key: ExpertKey) -> None:
        self._counts[key] += 1
        self._touch(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._index.discard(key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        victim = self._index.first_in(candidates)
        if victim is None:
            victim = min(candidates, key=lambda k: self._index.get(k, (self._counts[k], -1)))
        return victim

    def _touch(self, key: ExpertKey) -> None:
        self._clock += 1
        self._index.set(key, (self._counts[key], self._clock))
