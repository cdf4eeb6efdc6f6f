"""Residency of experts in a fixed number of slots: the mechanism every tier and the simulator share.

The cache owns the key -> slot map, pins and free slots; it asks its eviction policy for a victim
and tells it about inserts, accesses and removals. It knows no policy and moves no bytes.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from moestream.errors import BudgetError
from moestream.policies.base import EvictionPolicy
from moestream.topology import ExpertKey


class CacheFullError(BudgetError):
    """Every slot holds a pinned expert, so nothing can be admitted."""


class ExpertCache:
    def __init__(self, capacity: int, policy: EvictionPolicy):
        if capacity < 1:
            raise BudgetError(f"a cache needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self._slots: dict[ExpertKey, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._pins: Counter[ExpertKey] = Counter()

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def resident(self) -> frozenset[ExpertKey]:
        return frozenset(self._slots)

    def slot(self, key: ExpertKey) -> int | None:
        return self._slots.get(key)

    def access(self, key: ExpertKey) -> int | None:
        """The slot of a resident expert (telling the policy), or None on a miss."""
        slot = self._slots.get(key)
        if slot is not None:
            self.policy.on_access(key)
        return slot

    def admit(self, key: ExpertKey) -> tuple[int, ExpertKey | None]:
        """A slot for key, evicting a victim if full. Returns (slot, evicted key or None)."""
        if key in self._slots:
            return self._slots[key], None
        evicted = None if self._free else self._evict()
        slot = self._free.pop()
        self._slots[key] = slot
        self.policy.on_insert(key)
        return slot, evicted

    def remove(self, key: ExpertKey) -> int:
        slot = self._slots.pop(key)
        self._pins.pop(key, None)
        self._free.append(slot)
        self.policy.on_remove(key)
        return slot

    def pin(self, keys: Iterable[ExpertKey]) -> None:
        self._pins.update(keys)

    def unpin(self, keys: Iterable[ExpertKey]) -> None:
        self._pins.subtract(keys)
        self._pins = +self._pins

    def is_pinned(self, key: ExpertKey) -> bool:
        return self._pins[key] > 0

    def evictable(self) -> list[ExpertKey]:
        return [key for key in self._slots if self._pins[key] <= 0]

    def _evict(self) -> ExpertKey:
        candidates = self.evictable()
        if not candidates:
            raise CacheFullError(f"all {self.capacity} slots hold experts in use; raise the budget")
        victim = self.policy.victim(candidates)
        self.remove(victim)
        return victim
