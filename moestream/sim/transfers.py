"""Links in virtual time: one transfer at a time, demand loads first, then planned prefetches; and the
view of the device tier that planning reads (`ReadyKeys`).

A link keeps the transfers it has committed (start and end known, in order), the prefetches it
was asked for and has not started (in plan order, replaced by every new plan) and the in-flight
transfers that arrived from a lower link and wait for it. It knows no cache and no policy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set
from typing import Iterable

from moestream.cache import ExpertCache
from moestream.topology import ExpertKey

# stages of a transfer towards the device tier; DROPPED: given up before it started
DROPPED, QUEUED, LOWER, WAITING, MOVING = range(5)


class Transfer:
    """One expert on its way to the device tier (through the host tier when it must)."""

    __slots__ = ("key", "prefetch", "stage", "end_ms", "lower_end_ms", "waited", "device_pinned", "host_pinned")

    def __init__(self, key: ExpertKey, prefetch: bool):
        self.key = key
        self.prefetch = prefetch  # asked for by a plan (else a demand load)
        self.stage = QUEUED
        self.end_ms = 0.0  # when it lands in the device tier (once committed there)
        self.lower_end_ms = 0.0  # when it lands in the host tier (once committed on the lower link)
        self.waited = False  # a layer needed it before it landed (a late prefetch)
        self.device_pinned = False  # holds a pin in the device tier while it moves
        self.host_pinned = False  # holds a pin in the host tier until it lands in the device tier


class Link:
    """A copy engine between two tiers, one expert at a time."""

    def __init__(self, name: str, transfer_ms: float, nbytes: int):
        self.name = name
        self.transfer_ms = transfer_ms
        self.nbytes = nbytes
        self.free_ms = 0.0  # when the last committed transfer ends (or the link went idle)
        self.running: deque[tuple[float, Transfer]] = deque()  # (end, transfer) committed, in order
        self.planned: deque[Transfer] = deque()  # prefetches not started, best first
        self.waiting: list[Transfer] = []  # in flight, arrived from the lower link
        self.bytes_moved = 0

    def commit(self, transfer: Transfer, earliest_ms: float) -> float:
        """Schedule transfer after everything committed and not before earliest_ms; its end."""
        start = self.free_ms if self.free_ms > earliest_ms else earliest_ms
        end = self.free_ms = transfer.end_ms = start + self.transfer_ms
        self.running.append((end, transfer))
        self.bytes_moved += self.nbytes
        return end

    def commit_many(self, count: int, earliest_ms: float, batch_ms: float = 0.0) -> list[float]:
        """Schedule count anonymous back-to-back transfers (demand loads nobody tracks), read as one batch
        whose first lands batch_ms (its fixed cost) plus one transfer after it starts; when each lands."""
        start = self.free_ms if self.free_ms > earliest_ms else earliest_ms
        first = start + batch_ms
        lands = [first + (i + 1) * self.transfer_ms for i in range(count)]
        self.free_ms = lands[-1] if lands else start
        self.bytes_moved += count * self.nbytes
        return lands

    def completed(self, until_ms: float) -> list[Transfer]:
        """Pop the committed transfers that end by until_ms, in order."""
        done = []
        running = self.running
        while running and running[0][0] <= until_ms:
            done.append(running.popleft()[1])
        return done

    def wake(self, now_ms: float) -> None:
        """An idle link can start new work no earlier than now."""
        if self.free_ms < now_ms:
            self.free_ms = now_ms

    def next_planned(self) -> Transfer | None:
        """The best in-flight waiter, else the best planned prefetch still queued."""
        if self.waiting:
            return self.waiting.pop(0)
        while self.planned:
            transfer = self.planned.popleft()
            if transfer.stage == QUEUED:
                return transfer
        return None

    def drop_planned(self) -> list[Transfer]:
        """Forget the queued prefetches (a new plan replaces them); those still queued."""
        dropped = [t for t in self.planned if t.stage == QUEUED]
        self.planned.clear()
        return dropped


class ReadyKeys(Set):
    """The device tier's landed experts, as a read-only set that stays valid while a planner runs."""

    def __init__(self, cache: ExpertCache, moving: Set):
        self._cache, self._moving = cache, moving

    @classmethod
    def _from_iterable(cls, keys: Iterable) -> frozenset:
        return frozenset(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._cache and key not in self._moving

    def __iter__(self):
        return (key for key in self._cache.resident() if key not in self._moving)

    def __len__(self) -> int:
        return sum(1 for _ in self)
