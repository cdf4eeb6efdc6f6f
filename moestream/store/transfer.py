"""Asynchronous expert transfers: a re-prioritisable, cancellable queue and the I/O worker of the disk link.

A `Transfer` moves one expert's bytes from the checkpoint's files into its slot, chunk by chunk
(one chunk per weight matrix, or pieces of at most `chunk_bytes`). The `TransferQueue` orders
transfers: demand transfers (the compute thread waits on them) first, in the order asked, then
speculative ones by priority. Requests are re-prioritised and cancelled by key, and the queue never
holds more transfers than it was sized for. The `DiskWorker` thread reads every queued demand
transfer whole, all at once; otherwise it reads up to `max_chunks` chunks from the head of the
queue together (each its own request in flight, so that the disk is kept busy), then puts the
unfinished transfers back and looks at the queue again: a demand miss waits at most for one round
of chunks in flight behind speculative work.

Queue and worker share the store's condition: every change of the queue happens under its lock, and
the worker reads outside it. The worker reports each finished or failed transfer through the two
callbacks it is given; it knows no eviction, no policy and no tier. `LinkWorker` is what every
link's thread shares (start, stop, the callbacks); the host -> device link's is in
`moestream.store.copier`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from moestream.checkpoint.layout import Segment
from moestream.errors import MoestreamError
from moestream.tracer import Tracer, expert_names
from moestream.topology import ExpertKey

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle worker sleeps before it checks for stop again
MAX_CHUNKS_IN_FLIGHT = 8  # speculative chunks read together (each its own request in flight)
DISK, H2D = "disk", "h2d"  # the links a transfer moves on: disk -> slot, host slot -> device slot


class TransferError(MoestreamError):
    """An expert's bytes could not be brought in: a failed read, a timeout, or a closed store."""


@dataclass(frozen=True)
class Chunk:
    segments: tuple[Segment, ...]
    dst: torch.Tensor  # [nbytes] uint8 view of the expert's slot


@dataclass(eq=False)
class Transfer:
    key: ExpertKey
    chunks: list[Chunk]
    priority: float = 0.0  # speculative ranking, higher first
    demand: bool = False  # the compute thread waits on it
    order: int = 0  # tie-break: first asked, first served
    next_chunk: int = 0
    continued: bool = False  # the second stage of a transfer that has started (a copy after its read)
    link: str = DISK  # which link moves it (its queue)
    held: bool = False  # a worker is moving its chunks now (outside the lock)
    dropped: bool = False  # its expert left the tier: no chunk of it is moved again

    @property
    def rank(self) -> tuple:
        return (0, self.order) if self.demand else (1, -self.priority, self.order)

    @property
    def started(self) -> bool:
        return self.continued or self.next_chunk > 0

    @property
    def done(self) -> bool:
        return self.next_chunk >= len(self.chunks)


def pieces(segments: Sequence[Segment], chunk_bytes: int) -> list[tuple[Segment, int]]:
    """An expert's bytes as chunks: one per segment (weight matrix), or pieces of <= chunk_bytes (> 0);
    each as (its part of the segment, its offset in the expert's slot)."""
    out, at = [], 0
    for seg in segments:
        step = seg.nbytes if chunk_bytes <= 0 else chunk_bytes
        for start in range(0, seg.nbytes, step):
            n = min(step, seg.nbytes - start)
            out.append((Segment(seg.file, seg.offset + start, n), at))
            at += n
    return out


def chunks_of(segments: Sequence[Segment], slot: torch.Tensor, chunk_bytes: int) -> list[Chunk]:
    """The disk reads that fill the slot, chunk by chunk (`pieces`)."""
    return [Chunk((part,), slot[at : at + part.nbytes]) for part, at in pieces(segments, chunk_bytes)]


@dataclass
class TransferQueue:
    """Pending transfers by rank, with lazy deletion; at most `capacity` of them (and a bounded heap)."""

    capacity: int
    _heap: list = field(default_factory=list)  # [(rank, transfer)]; stale entries skipped on pop
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
        while self._heap:
            rank, _, transfer = heapq.heappop(self._heap)
            if self._queued.get(transfer.key) is transfer and rank == transfer.rank:
                del self._queued[transfer.key]
                return transfer
        return None

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
        """Removes a queued transfer (not the one the worker is reading); returns it."""
        return self._queued.pop(key, None)

    def speculative(self) -> list[Transfer]:
        """Queued speculative transfers, lowest priority first."""
        return sorted((t for t in self._queued.values() if not t.demand), key=lambda t: t.priority)

    def drain(self) -> list[Transfer]:
        queued = list(self._queued.values())
        self._queued.clear()
        self._heap.clear()
        return queued


@dataclass(frozen=True)
class LinkReports:
    """What a link's worker tells its store, each under the store's lock."""

    landed: Callable[[Transfer], None]  # every chunk of the transfer has moved
    failed: Callable[[Transfer, BaseException], None]  # it cannot move; the error is for whoever waits on it
    busy: Callable[[float], None]  # seconds the link was busy for one round
    released: Callable[[Transfer], None] = lambda transfer: None  # a dropped transfer it held, let go


class LinkWorker(ABC):
    """One link's I/O thread over a queue it shares with the store (the condition's lock guards both).

    Each round it takes chunks from the head of the queue (`_take`), moves them outside the lock
    (`_step`, the link's own), and puts the unfinished transfers back, so that whatever ranks ahead
    now goes first: a demand waits at most for one round behind speculative work. It reports each
    finished or failed transfer and the time it was busy through its `LinkReports`, all called under
    the lock."""

    name = "link"

    def __init__(self, cond: threading.Condition, queue: TransferQueue, reports: LinkReports,
                 max_chunks: int = MAX_CHUNKS_IN_FLIGHT):
        self._cond, self._queue, self._reports = cond, queue, reports
        self.max_chunks = max_chunks
        self._stopping = False
        self.timeline: Tracer | None = None  # records each round when set
        self._thread = threading.Thread(target=self._run, name=f"moestream-{self.name}-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TransferError(f"the {self.name} worker did not stop within {timeout_s:g} s")

    @abstractmethod
    def _step(self, held: list[tuple[Transfer, int]]) -> None:
        """Moves the held chunks (outside the lock); reports the transfers that finished or failed."""

    def _run(self) -> None:
        held: list[tuple[Transfer, int]] = []
        while True:
            with self._cond:
                held = self._take()
                if not held:
                    return
            began, timeline = time.perf_counter(), self.timeline  # read once: the compute thread may reset it
            self._step(held)
            if timeline is not None:
                timeline.add(self.name, lambda: _label(held), began, time.perf_counter())

    def _take(self) -> list[tuple[Transfer, int]]:
        """What to move next, as (transfer, number of its next chunks); empty: stop.

        Demand transfers are moved whole, all those queued together. Speculative ones give up to
        max_chunks chunks from the head of the queue, moved together, after which the queue is
        consulted again."""
        while not self._stopping:
            head = self._queue.pop()
            if head is None:
                self._cond.wait(IDLE_WAIT_S)
                continue
            taken, room = [], self.max_chunks
            while head is not None:
                left = len(head.chunks) - head.next_chunk
                count = left if head.demand else min(room, left)
                taken.append((head, count))
                head.held = True
                room -= count
                rank = self._queue.head_rank()
                if rank is None or (rank[0] != 0 and (head.demand or room <= 0)):
                    break
                head = self._queue.pop()
            return taken
        return []

    def _finish(self, began: float, held: list[tuple[Transfer, int]], errors: dict[Transfer, BaseException]) -> None:
        """Under the lock: the round's busy time; each held transfer advanced, landed or failed, or back
        in the queue (whatever ranks ahead now goes first; a dropped one is moved no further)."""
        self._reports.busy(time.perf_counter() - began)
        for transfer, count in held:
            transfer.held = False
            if transfer.dropped:  # its expert left the tier: moved no further
                self._reports.released(transfer)
            elif transfer in errors:
                transfer.next_chunk = len(transfer.chunks)
                self._reports.failed(transfer, errors[transfer])
            else:
                transfer.next_chunk += count
                if transfer.done:
                    self._reports.landed(transfer)
                else:
                    self._queue.push(transfer, new=False)
        self._cond.notify_all()


def _label(held: list[tuple[Transfer, int]]) -> str:
    demand = any(transfer.demand for transfer, _ in held)
    experts = expert_names(t.key for t, _ in held)
    return f"{'demand' if demand else 'speculative'} {experts}"


class DiskWorker(LinkWorker):
    """The disk link's one I/O thread (see the module doc)."""

    name = DISK

    def __init__(self, cond: threading.Condition, queue: TransferQueue,
                 read: Callable[[Sequence[tuple[Sequence[Segment], torch.Tensor]]], int], reports: LinkReports,
                 max_chunks: int = MAX_CHUNKS_IN_FLIGHT):
        super().__init__(cond, queue, reports, max_chunks)
        self._read = read
        self.start()

    def _step(self, held: list[tuple[Transfer, int]]) -> None:
        """Reads the held chunks together (one failed read fails them all)."""
        batch = [(chunk.segments, chunk.dst) for transfer, count in held
                 for chunk in transfer.chunks[transfer.next_chunk : transfer.next_chunk + count]]
        began, errors = time.perf_counter(), {}
        try:
            self._read(batch)
        except BaseException as error:  # handed to the thread that waits on these experts
            log.debug("a disk read of %d chunks failed: %s", len(batch), error)
            errors = {transfer: error for transfer, _ in held}
        with self._cond:
            self._finish(began, held, errors)
