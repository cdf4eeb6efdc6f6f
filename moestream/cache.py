"""Residency of experts in a fixed number of slots: the mechanism every tier and the simulator share. The
cache owns the key -> slot map, pins and free slots; it asks its eviction policy for a victim and tells it
about inserts, accesses and removals. It knows no policy and moves no bytes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence
from typing import Iterable, Iterator

from moestream.contracts import EvictionPolicy
from moestream.errors import BudgetError
from moestream.topology import ExpertKey


class CacheFullError(BudgetError):
    """Every slot holds a pinned expert, so nothing can be admitted."""


class ExpertCache:
    def __init__(self, capacity: int, policy: EvictionPolicy):
        if capacity < 1:
            raise BudgetError(f"a cache needs at least one slot, got {capacity}")
        self.capacity, self.policy = capacity, policy
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

    def admit(self, key: ExpertKey, protect: Container[ExpertKey] = ()) -> tuple[int, ExpertKey | None]:
        """(slot, evicted key or None), evicting a victim (never pinned or protected) if full; else CacheFullError."""
        if key in self._slots:
            return self._slots[key], None
        evicted = None
        if not self._free:
            candidates = Evictable(self._slots, self._pins, protect)
            if not candidates:
                raise CacheFullError(f"all {self.capacity} slots hold experts in use; raise the budget")
            evicted = self.policy.victim(candidates)
            self.remove(evicted)
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
        pins = self._pins
        for key in keys:
            count = pins.get(key, 0) - 1
            if count > 0:
                pins[key] = count
            else:
                pins.pop(key, None)

    def pinned(self) -> frozenset[ExpertKey]:
        """The resident keys with at least one pin (O(pinned), not O(capacity))."""
        return frozenset(key for key, count in self._pins.items() if count > 0 and key in self._slots)

    def pin_holders(self) -> frozenset[ExpertKey]:
        """Every key holding a pin, resident or not (a pin left on a key that left is a leak)."""
        return frozenset(key for key, count in self._pins.items() if count > 0)

    def evictable(self) -> list[ExpertKey]:
        return list(Evictable(self._slots, self._pins))

    def has_evictable(self) -> bool:
        """Whether some resident key may be evicted (stops at the first one; no list is built)."""
        return bool(Evictable(self._slots, self._pins))


class Evictable(Sequence):
    """The resident keys that are neither pinned nor protected, as a read-only sequence. Membership and truth
    cost O(1), not O(capacity), so an eviction policy that walks its own order and tests `key in candidates`
    stays cheap; len, indexing and iteration build the list once."""

    def __init__(self, slots: dict, pins: Counter, protect: Container[ExpertKey] = ()):
        self._slots, self._pins, self._protect = slots, pins, protect
        self._list: list[ExpertKey] | None = None

    def __contains__(self, key: object) -> bool:
        return key in self._slots and self._pins.get(key, 0) <= 0 and key not in self._protect

    def __bool__(self) -> bool:
        pins, protect = self._pins, self._protect
        return any(pins.get(key, 0) <= 0 and key not in protect for key in self._slots)

    def __len__(self) -> int:
        return len(self._as_list())

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._as_list())

    def __getitem__(self, index):
        return self._as_list()[index]

    def _as_list(self) -> list[ExpertKey]:
        if self._list is None:
            self._list = [key for key in self._slots if key in self]
        return self._list
