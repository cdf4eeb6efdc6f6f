"""Links in virtual time: one transfer at a time, demand loads first, then planned prefetches.

A link keeps the transfers it has committed (start and end known, in order), the prefetches it
was asked for and has not started (best first, by priority then by when they were asked for, as
the engine's transfer queue ranks them; a later plan may re-rank one) and the in-flight transfers
that arrived from a lower link and wait for it. It knows no cache and no policy.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from moestream.topology import ExpertKey

# stages of a transfer towards the device tier; DROPPED: given up before it started
DROPPED, QUEUED, LOWER, WAITING, MOVING = range(5)


class Transfer:
    """One expert on its way to the device tier (through the host tier when it must)."""

    __slots__ = ("key", "prefetch", "priority", "order", "stage", "end_ms", "lower_end_ms", "waited", "host_pinned")

    def __init__(self, key: ExpertKey, prefetch: bool, priority: float = 0.0):
        self.key = key
        self.prefetch = prefetch  # asked for by a plan (else a demand load)
        self.priority = priority  # a prefetch's rank on its link, higher first
        self.order = 0  # then first asked, first served
        self.stage = QUEUED
        self.end_ms = 0.0  # when it lands in the device tier (once committed there)
        self.lower_end_ms = 0.0  # when it lands in the host tier (once committed on the lower link)
        self.waited = False  # a layer needed it before it landed (a late prefetch)
        self.host_pinned = False  # holds a pin in the host tier until it lands in the device tier


class Link:
    """A copy engine between two tiers, one expert at a time."""

    def __init__(self, name: str, transfer_ms: float, nbytes: int):
        self.name = name
        self.transfer_ms = transfer_ms
        self.nbytes = nbytes
        self.free_ms = 0.0  # when the last committed transfer ends (or the link went idle)
        self.running: deque[tuple[float, Transfer]] = deque()  # (end, transfer) committed, in order
        self.planned: list[tuple[float, int, int, Transfer]] = []  # heap of prefetches not started (stale entries skipped)
        self._orders = itertools.count()
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

    def plan(self, transfer: Transfer, again: bool = False) -> None:
        """Queue a prefetch at its priority (again: re-ranked by a later plan, it keeps its order)."""
        if not again:
            transfer.order = next(self._orders)
        heapq.heappush(self.planned, (-transfer.priority, transfer.order, next(self._orders), transfer))

    def next_planned(self) -> Transfer | None:
        """The best in-flight waiter, else the best planned prefetch still queued."""
        if self.waiting:
            return self.waiting.pop(0)
        while self.planned:
            rank, _, _, transfer = heapq.heappop(self.planned)
            if transfer.stage == QUEUED and rank == -transfer.priority:
                return transfer
        return None
