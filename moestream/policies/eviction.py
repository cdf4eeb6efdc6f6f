"""Eviction policies that need nothing but the accesses they see, and the base of those that evict by a
score. None knows the tier or what a score means."""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections import Counter, OrderedDict
from typing import Any, Sequence

import numpy as np

from moestream.contracts import EVICTIONS, EvictionPolicy
from moestream.topology import ExpertKey


@EVICTIONS.register("lru")
class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted or accessed expert."""

    def __init__(self):
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        # tests membership key by key: the cache's candidates answer `in` in O(1)
        for key in self._order:
            if key in candidates:
                return key
        return candidates[0]


def forwarded(hook: str, *policies: str):
    """A hook that passes its one argument to the same hook of each named attribute's policy, in order."""

    def forward(self, argument) -> None:
        for name in policies:
            getattr(getattr(self, name), hook)(argument)

    forward.__name__ = forward.__qualname__ = hook
    return forward


class NarrowingEviction(EvictionPolicy):
    """Passes every hook to an inner policy; a subclass changes one decision (e.g. narrows the candidates)."""

    def __init__(self, inner: EvictionPolicy):
        self.inner = inner

    on_insert = forwarded("on_insert", "inner")
    on_access = forwarded("on_access", "inner")
    on_remove = forwarded("on_remove", "inner")
    begin_iteration = forwarded("begin_iteration", "inner")
    observe = forwarded("observe", "inner")
    end_sequence = forwarded("end_sequence", "inner")


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
    """Evicts the expert accessed least often over the run, ties to the least recent (a victim: O(log n))."""

    def __init__(self):
        self._counts: Counter[ExpertKey] = Counter()
        self._clock = 0
        self._index = PriorityIndex()  # resident key -> (count, last insert or access)

    def on_insert(self, key: ExpertKey) -> None:
        self._clock += 1
        self._index.set(key, (self._counts[key], self._clock))

    def on_access(self, key: ExpertKey) -> None:
        self._counts[key] += 1
        self.on_insert(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._index.discard(key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        victim = self._index.first_in(candidates)
        if victim is None:
            victim = min(candidates, key=lambda k: self._index.get(k, (self._counts[k], -1)))
        return victim


class ScoredEviction(EvictionPolicy):
    """Evicts the lowest score, ties to the least recently used (MoE-Infinity, fMoE subclass it). The [L, E]
    scores are computed once per change of their inputs, the residents then heaped as (score, recency stamp,
    row); a victim is the first entry still current and allowed; stale entries are dropped when met."""

    def __init__(self):
        self._index: dict[ExpertKey, int] = {}  # resident key -> row of the arrays below
        self._keys: list[ExpertKey | None] = []  # row -> key (None: a free row)
        self._rows = np.zeros((0, 3), dtype=np.int64)  # [R, (layer, expert, stamp)]; stamp -1: free
        self._free: list[int] = []
        self._clock = 0
        self._inputs: tuple = ()  # score_inputs() when the scores were computed
        self._scores: np.ndarray | None = None  # [L, E]
        self._heap: list[tuple[float, int, int]] | None = None  # (score, stamp, row), lazily pruned

    @abstractmethod
    def score_matrix(self) -> np.ndarray:
        """[L, E] retention score of every expert now; the lowest resident one goes first."""

    @abstractmethod
    def score_inputs(self) -> tuple:
        """The objects score_matrix() reads, compared by identity: a subclass replaces them, never mutates."""

    def on_remove(self, key: ExpertKey) -> None:
        row = self._index.pop(key, None)
        if row is not None:
            self._keys[row] = None
            self._rows[row, 2] = -1
            self._free.append(row)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        heap, rows, passed, found = self._current_heap(), self._rows, [], None
        while heap:
            score, stamp, row = heap[0]
            if rows[row, 2] != stamp:  # touched again or removed since this entry
                heapq.heappop(heap)
            elif self._keys[row] in candidates:
                found = self._keys[row]
                break
            else:  # pinned or protected now: it stays for later victims
                passed.append(heapq.heappop(heap))
        for entry in passed:
            heapq.heappush(heap, entry)
        return candidates[0] if found is None else found  # None: only keys this policy never saw

    def _current_heap(self) -> list[tuple[float, int, int]]:
        inputs = self.score_inputs()
        stale = len(inputs) != len(self._inputs) or any(a is not b for a, b in zip(inputs, self._inputs))
        if stale or self._heap is None:
            if stale or self._scores is None:
                self._scores, self._inputs = self.score_matrix(), inputs
            live = np.flatnonzero(self._rows[:, 2] >= 0)  # [n] rows of resident keys
            layers, experts, stamps = self._rows[live].T
            self._heap = list(zip(self._scores[layers, experts].tolist(), stamps.tolist(), live.tolist()))
            heapq.heapify(self._heap)
        return self._heap

    def on_insert(self, key: ExpertKey) -> None:
        self._clock += 1
        row = self._index.get(key)
        if row is None:
            row = self._new_row()
            self._index[key] = row
            self._keys[row] = key
            self._rows[row, :2] = key
        self._rows[row, 2] = self._clock
        if self._heap is not None and len(self._heap) > 4 * max(len(self._index), 16):
            self._heap = None  # mostly stale entries (a run of hits): rebuilt at the next victim
        elif self._heap is not None:
            heapq.heappush(self._heap, (float(self._scores[key]), self._clock, row))

    on_access = on_insert

    def _new_row(self) -> int:
        if self._free:
            return self._free.pop()
        grown = max(64, 2 * len(self._rows))
        self._free = list(range(grown - 1, len(self._rows) - 1, -1))
        self._keys += [None] * (grown - len(self._rows))
        self._rows = np.vstack([self._rows, np.full((grown - len(self._rows), 3), -1, dtype=np.int64)])
        return self._free.pop()
