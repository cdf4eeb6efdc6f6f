"""Transfers and links: what moves an expert's bytes, in which order, and how a round of them moves.

A `Transfer` moves one expert's bytes into its slot chunk by chunk, from the checkpoint (`DISK`) or
its host slot (`H2D`). A `TransferQueue` orders a link's transfers: demand first, in the order asked,
then speculative ones by priority; it never holds more than it was sized for.

A `TransferLink` is a queue, a copy function and the round between them: `take` (under the store's
lock), `move` (outside it), `finish` (under it: the unfinished go back to the queue, so that a demand
waits at most one round behind speculative work, and each landed, failed or dropped transfer is
reported through `LinkReports`). Slots and events are handles the copy function reads (the engine's:
`moestream.store.copies`; the simulator's move nothing). A link knows no clock, no torch, no
eviction, no policy and no tier.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from moestream.errors import MoestreamError
from moestream.topology import ExpertKey
from moestream.tracer import expert_names

if TYPE_CHECKING:  # the checkpoint's records (its module imports torch)
    from moestream.checkpoint.layout import ExpertCheck, Segment

DISK, H2D = "disk", "h2d"  # the links (and their tracer lanes): disk -> slot, host slot -> device slot

Held = list[tuple["Transfer", int]]  # a round: each transfer taken, with how many of its next chunks
Errors = dict["Transfer", BaseException]


class TransferError(MoestreamError):
    """An expert's bytes could not be brought in: a failed read, a timeout, or a closed store."""


@dataclass(eq=False)
class Transfer:
    key: ExpertKey
    dst: Any  # the slot its bytes go to (the engine's: a [expert bytes] uint8 tensor)
    parts: list[tuple[Segment, int]]  # its chunks: a piece of the checkpoint and where it lies in the slot
    src: Any = None  # the host slot an H2D copy reads
    priority: float = 0.0  # speculative ranking, higher first
    demand: bool = False  # the compute thread waits on it
    order: int = 0  # tie-break: first asked, first served
    next_chunk: int = 0
    link: str = DISK  # which link moves it (its queue)
    held: bool = False  # a round is moving its chunks now (outside the lock)
    dropped: bool = False  # its expert left the tier: no chunk of it is moved again
    after: Any = None  # dst's last reader, an event: whatever writes dst waits for it
    event: Any = None  # the last copy issued into dst, an event (None: the bytes are there when moved)
    staged: bool = False  # a copy up of the bytes its read just brought into the host tier (not its first link)
    check: ExpertCheck | None = None  # a disk read's integrity check, fed each chunk in host memory

    @property
    def rank(self) -> tuple:
        return (0, self.order) if self.demand else (1, -self.priority, self.order)

    @property
    def done(self) -> bool:
        return self.next_chunk >= len(self.parts)

    def piece(self, count: int) -> tuple[tuple[Segment, ...], slice]:
        """The next count chunks: their pieces of the checkpoint, and the part of the slot they fill."""
        parts = self.parts[self.next_chunk : self.next_chunk + count]
        end = parts[-1][1] + parts[-1][0].nbytes
        return tuple(segment for segment, _ in parts), slice(parts[0][1], end)


def pieces(segments: Sequence[Segment], chunk_bytes: int) -> list[tuple[Segment, int]]:
    """An expert's chunks, (part of a segment, offset in the slot): one per segment, or of <= chunk_bytes (> 0)."""
    out, at = [], 0
    for seg in segments:
        step = seg.nbytes if chunk_bytes <= 0 else chunk_bytes
        for start in range(0, seg.nbytes, step):
            n = min(step, seg.nbytes - start)
            out.append((replace(seg, offset=seg.offset + start, nbytes=n), at))
            at += n
    return out


@dataclass
class TransferQueue:
    """Pending transfers by rank, with lazy deletion; at most `capacity` of them (and a bounded heap)."""

    capacity: int
    _heap: list = field(default_factory=list)  # [(rank, order, transfer)]; stale entries skipped on pop
    _queued: dict[ExpertKey, Transfer] = field(default_factory=dict)
    _orders: itertools.count = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, key: object) -> bool:
        return key in self._queued

    def push(self, transfer: Transfer, new: bool = True) -> None:
        if transfer.key in self._queued:
            raise ValueError(f"expert {tuple(transfer.key)} is queued already")
        if len(self._queued) >= self.capacity:
            raise TransferError(f"the transfer queue holds {self.capacity} requests already")
        if new:
            transfer.order = next(self._orders)
        self._queued[transfer.key] = transfer
        self._add(transfer)

    def pop(self) -> Transfer | None:
        if self.head_rank() is None:
            return None
        transfer = heapq.heappop(self._heap)[2]
        return self._queued.pop(transfer.key)

    def head_rank(self) -> tuple | None:
        while self._heap:
            rank, _, transfer = self._heap[0]
            if self._queued.get(transfer.key) is transfer and rank == transfer.rank:
                return rank
            heapq.heappop(self._heap)
        return None

    def reprioritise(self, transfer: Transfer, priority: float | None = None, demand: bool = False) -> None:
        """New priority (speculative) or demand; a demand transfer keeps its head position."""
        if demand and not transfer.demand:
            transfer.demand, transfer.order = True, next(self._orders)
        elif not transfer.demand and priority is not None:
            transfer.priority = priority
        if self._queued.get(transfer.key) is transfer:
            self._add(transfer)

    def _add(self, transfer: Transfer) -> None:
        """A heap entry for the transfer's rank; stale entries are swept once they outnumber the live ones."""
        heapq.heappush(self._heap, (transfer.rank, transfer.order, transfer))
        if len(self._heap) > 2 * self.capacity + 16:
            self._heap = [(t.rank, t.order, t) for t in self._queued.values()]
            heapq.heapify(self._heap)

    def cancel(self, key: ExpertKey) -> Transfer | None:
        """Removes a queued transfer (not one a round is moving); returns it."""
        return self._queued.pop(key, None)

    def speculative(self) -> list[Transfer]:
        """Queued speculative transfers, lowest priority first."""
        return sorted((t for t in self._queued.values() if not t.demand), key=lambda t: t.priority)

    def drain(self) -> None:
        self._queued.clear()
        self._heap.clear()


@dataclass(frozen=True)
class LinkReports:
    """What a link tells its store, each under the store's lock."""

    landed: Callable[[Transfer], None]  # every chunk of the transfer has moved
    failed: Callable[[Transfer, BaseException], None]  # it cannot move; the error is for whoever waits on it
    released: Callable[[Transfer], None] = lambda transfer: None  # a dropped transfer a round held, let go
    rounds: Callable[[int, float], None] = lambda experts, seconds: None  # a round of experts, its seconds


class TransferLink:
    """One link: its queue, its copy function and its rounds (see the module doc)."""

    def __init__(self, lane: str, queue: TransferQueue, move: Callable[[Held], Errors], reports: LinkReports):
        self.lane, self.queue, self.reports = lane, queue, reports
        self._move = move

    def take(self, max_chunks: int | None) -> Held:
        """Under the lock: every queued demand transfer whole, else up to max_chunks (None: all) speculative chunks."""
        taken, room, head = [], float("inf") if max_chunks is None else max_chunks, self.queue.pop()
        while head is not None:
            left = len(head.parts) - head.next_chunk
            count = left if head.demand else int(min(room, left))
            taken.append((head, count))
            head.held, room = True, room - count
            rank = self.queue.head_rank()
            if rank is None or (rank[0] != 0 and (head.demand or room <= 0)):
                break
            head = self.queue.pop()
        return taken

    def move(self, held: Held) -> Errors:
        """Outside the lock: moves the round's chunks; returns the transfers that failed."""
        return self._move(held)

    def finish(self, held: Held, errors: Errors, seconds: float = 0.0) -> None:
        """Under the lock: each held transfer landed, failed, released (dropped) or back in the queue."""
        self.reports.rounds(len(held), seconds)
        for transfer, count in held:
            transfer.held = False
            if transfer.dropped:  # its expert left the tier: moved no further
                self.reports.released(transfer)
            elif transfer in errors:
                transfer.next_chunk = len(transfer.parts)
                self.reports.failed(transfer, errors[transfer])
            else:
                transfer.next_chunk += count
                if transfer.done:
                    self.reports.landed(transfer)
                else:
                    self.queue.push(transfer, new=False)


def label(held: Held) -> str:
    """A round's words on its lane: demand or speculative, and its experts."""
    demand = any(transfer.demand for transfer, _ in held)
    return f"{'demand' if demand else 'speculative'} {expert_names(t.key for t, _ in held)}"
