"""Eviction by a formula over the resident experts: the lowest score goes, ties to the least recently
used. Designs whose replacement rule is a score (MoE-Infinity, fMoE) subclass it with `score_matrix`.

Residents live in flat numpy arrays (layer, expert, recency stamp), so a victim is one gather from
the [L, E] score matrix, one lexsort, and membership tests in ascending order until an allowed
candidate comes up: no per-resident Python work. It knows nothing of the tier or of the scores.
"""

from __future__ import annotations

from abc import abstractmethod
from itertools import chain
from typing import Iterable, Sequence

import numpy as np

from moestream.policies.contracts import EvictionPolicy
from moestream.topology import ExpertKey


def key_array(keys: Iterable[ExpertKey], count: int) -> np.ndarray:
    """[count, 2] int64 (layer, expert) rows of the keys."""
    return np.fromiter(chain.from_iterable(keys), dtype=np.int64, count=2 * count).reshape(count, 2)


class ScoredEviction(EvictionPolicy):
    """Evicts the candidate with the lowest score; among equals, the least recently used."""

    def __init__(self):
        self._index: dict[ExpertKey, int] = {}  # resident key -> row of the arrays below
        self._keys: list[ExpertKey | None] = []  # row -> key (None: a free row)
        self._rows = np.zeros((0, 3), dtype=np.int64)  # [R, (layer, expert, stamp)]; stamp -1: free
        self._free: list[int] = []
        self._clock = 0

    @abstractmethod
    def score_matrix(self) -> np.ndarray:
        """[L, E] retention score of every expert now; the lowest resident one goes first."""

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

    def priorities(self, candidates: Sequence[ExpertKey]) -> np.ndarray:
        """[n] the scores of the candidates."""
        keys = key_array(candidates, len(candidates))
        return self.score_matrix()[keys[:, 0], keys[:, 1]]

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        live = np.flatnonzero(self._rows[:, 2] >= 0)  # [n] rows of resident keys
        if len(live):
            layers, experts, stamps = self._rows[live].T
            scores = self.score_matrix()[layers, experts]
            for row in live[np.lexsort((stamps, scores))].tolist():
                if self._keys[row] in candidates:
                    return self._keys[row]
        return candidates[0]  # only candidates this policy was never told about

    def _touch(self, key: ExpertKey) -> None:
        self._clock += 1
        row = self._index.get(key)
        if row is None:
            row = self._new_row()
            self._index[key] = row
            self._keys[row] = key
            self._rows[row, :2] = key
        self._rows[row, 2] = self._clock

    def _new_row(self) -> int:
        if self._free:
            return self._free.pop()
        grown = max(64, 2 * len(self._rows))
        self._free = list(range(grown - 1, len(self._rows) - 1, -1))
        self._keys += [None] * (grown - len(self._rows))
        self._rows = np.vstack([self._rows, np.full((grown - len(self._rows), 3), -1, dtype=np.int64)])
        return self._free.pop()
