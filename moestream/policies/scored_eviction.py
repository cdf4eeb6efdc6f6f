"""Eviction by a formula over the resident experts: the lowest score goes, ties to the least recently
used. Designs whose replacement rule is a score (MoE-Infinity, fMoE) subclass it with `score_matrix`
and `score_inputs`.

The scores change when their inputs do (once per layer, typically), not at every victim. So the
[L, E] score matrix is computed once per change of its inputs, the residents are put in a heap of
(score, recency stamp, row) once then, and a victim is the heap's first entry that is still current
and allowed. A touch (insert, access) pushes the key again with its new stamp; entries left behind
by touches and removals are dropped when they come up. It knows nothing of the tier or of what the
scores mean.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from typing import Sequence

import numpy as np

from moestream.contracts import EvictionPolicy
from moestream.topology import ExpertKey


class ScoredEviction(EvictionPolicy):
    """Evicts the candidate with the lowest score; among equals, the least recently used."""

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
        """The objects score_matrix() reads. It is called again only when one of them is replaced
        (compared by identity), so a subclass replaces these arrays rather than changing them in place."""

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_access(self, key: ExpertKey) -> None:
        self._touch(key)

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

    def _touch(self, key: ExpertKey) -> None:
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

    def _new_row(self) -> int:
        if self._free:
            return self._free.pop()
        grown = max(64, 2 * len(self._rows))
        self._free = list(range(grown - 1, len(self._rows) - 1, -1))
        self._keys += [None] * (grown - len(self._rows))
        self._rows = np.vstack([self._rows, np.full((grown - len(self._rows), 3), -1, dtype=np.int64)])
        return self._free.pop()
