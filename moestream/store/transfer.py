"""Asynchronous expert transfers: a re-prioritisable, cancellable queue and the I/O worker of the disk link.

A `Transfer` moves one expert's bytes from the checkpoint's files into its slot, chunk by chunk
(one chunk per weight matrix, or pieces of at most `chunk_bytes`). The `TransferQueue` orders
transfers: demand transfers (the compute thread waits on them) first, in the order asked, then
speculative ones by priority. Requests are re-prioritised and cancelled by key, and the queue never
holds more transfers than it was sized for.

A link's worker (`LinkWorker`) keeps up to `max_chunks` moves in flight. A move is every queued
demand transfer whole, all together, or one chunk of the speculative transfer that ranks first.
Each time a move completes, the place it frees goes to whatever ranks first now, and while a demand
move is queued or in flight no speculative chunk starts: a demand miss starts as soon as one chunk
in flight completes, behind no speculative chunk started after it was queued. The `DiskWorker`
reads its moves on `max_chunks` threads, so that the disk keeps that many requests in flight (one
request at a time left it idle between 224 KiB reads); the chunks in flight beside a demand are
the only speculative work it waits behind.

Queue and worker share the store's condition: every change of the queue happens under its lock, and
the worker moves bytes outside it. A transfer with chunks in flight is held by the worker, out of
the queue, so that nothing cancels it while its slot is written; once none is in flight it lands,
fails or goes back to the queue. The worker reports each finished or failed transfer through the
two callbacks it is given; it knows no eviction, no policy and no tier. The host -> device link's
worker is in `moestream.store.copier`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from moestream.checkpoint.layout import Segment
from moestream.errors import MoestreamError
from moestream.timeline import Timeline
from moestream.topology import ExpertKey

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle worker sleeps before it checks for stop again
MAX_CHUNKS_IN_FLIGHT = 8  # the disk link's moves in flight at once (each its own read)


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
    next_chunk: int = 0  # chunks started
    settled: int = 0  # chunks started whose move has completed (moved or failed)
    error: BaseException | None = None  # the first failure of one of its moves

    @property
    def rank(self) -> tuple:
        return (0, self.order) if self.demand else (1, -self.priority, self.order)

    @property
    def left(self) -> int:
        """Chunks still to start (none once a move of it has failed)."""
        return 0 if self.error is not None else len(self.chunks) - self.next_chunk

    @property
    def moving(self) -> bool:
        """Whether chunks of it are in flight."""
        return self.settled < self.next_chunk


@dataclass(eq=False)
class Move:
    """Chunks moved together: (transfer, its first chunk here, number of chunks) each."""

    parts: list[tuple[Transfer, int, int]]
    demand: bool
    began_s: float = 0.0  # perf_counter when it started

    def chunks(self) -> list:
        return [chunk for transfer, first, count in self.parts for chunk in transfer.chunks[first : first + count]]


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

    def pop_demand(self) -> list[Transfer]:
        """Every queued demand transfer, in the order asked (removed from the queue)."""
        taken = []
        while (rank := self.head_rank()) is not None and rank[0] == 0:
            taken.append(self.pop())
        return taken

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


class LinkWorker(ABC):
    """One link's I/O thread over a queue it shares with the store (the condition's lock guards both).

    It keeps up to `max_chunks` moves in flight: under the lock it takes moves for the free places
    (`_take`), starts them outside it (`_issue`, the link's own), waits until one or more complete
    (`_wait`, the link's own) and settles them under the lock (see the module doc). It reports each
    finished or failed transfer through `landed` and `failed`, and through `busy` the seconds the
    link was busy since the last report and the stretches of moves in flight together begun since,
    all called under the lock."""

    name = "link"

    def __init__(self, cond: threading.Condition, queue: TransferQueue, landed: Callable[[Transfer], None],
                 failed: Callable[[Transfer, BaseException], None], busy: Callable[[float, int], None],
                 max_chunks: int):
        if max_chunks < 1:
            raise ValueError(f"a link needs max_chunks >= 1, got {max_chunks}")
        self._cond, self._queue = cond, queue
        self._landed, self._failed, self._busy = landed, failed, busy
        self.max_chunks = max_chunks
        self._stopping = False
        self._held: list[Transfer] = []  # transfers with chunks in flight, out of the queue
        self._demand_moves = 0  # demand moves in flight
        self._busy_since, self._stretches = 0.0, 0
        self.timeline: Timeline | None = None  # records each move when set
        self._thread = threading.Thread(target=self._run, name=f"moestream-{self.name}-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Ends the thread once the moves in flight have completed (none starts after this call)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TransferError(f"the {self.name} worker did not stop within {timeout_s:g} s")
        self._close()

    def _close(self) -> None:
        """Frees what the link's moves use, once the thread has ended."""

    @abstractmethod
    def _issue(self, move: Move) -> object:
        """Starts the move (outside the lock); returns what `_wait` waits on."""

    @abstractmethod
    def _wait(self, flight: list[tuple[Move, object]]) -> list[tuple[Move, dict[Transfer, BaseException]]]:
        """Blocks (outside the lock) until one or more moves in flight have completed; removes them from
        flight and returns each with the failures of its transfers."""

    def _run(self) -> None:
        flight: list[tuple[Move, object]] = []  # in the order started
        moved: list[tuple[Move, dict[Transfer, BaseException]]] = []
        while True:
            with self._cond:
                self._settle(moved)
                moved, moves = [], self._take(len(flight))
                if not (moves or flight):
                    if self._stopping:
                        return
                    self._cond.wait(IDLE_WAIT_S)
                    continue
                if moves and not flight:
                    self._busy_since, self._stretches = time.perf_counter(), self._stretches + 1
            for move in moves:
                move.began_s = time.perf_counter()
                flight.append((move, self._issue(move)))
            moved = self._wait(flight)

    def _take(self, in_flight: int) -> list[Move]:
        """Moves for the free places (none once stopping)."""
        moves: list[Move] = []
        while not self._stopping and in_flight + len(moves) < self.max_chunks:
            move = self._next_move()
            if move is None:
                break
            moves.append(move)
        return moves

    def _next_move(self) -> Move | None:
        """Every demand transfer's chunks left, whole, as one move; else, while no demand move is in flight,
        the next chunk of the speculative transfer that ranks first (a held one or the queue's head)."""
        demand = sorted((t for t in self._held if t.demand and t.left), key=lambda t: t.rank)
        demand += self._queue.pop_demand()
        if demand:
            self._demand_moves += 1
            return self._move(demand, demand=True)
        if self._demand_moves:
            return None
        held = min((t for t in self._held if t.left), key=lambda t: t.rank, default=None)
        rank = self._queue.head_rank()
        if rank is not None and (held is None or rank < held.rank):
            held = self._queue.pop()
        return None if held is None else self._move([held], demand=False, count=1)

    def _move(self, transfers: list[Transfer], demand: bool, count: int | None = None) -> Move:
        """The next chunks of transfers (all they have left, or count each), which the worker now holds."""
        parts = []
        for transfer in transfers:
            number = transfer.left if count is None else min(count, transfer.left)
            parts.append((transfer, transfer.next_chunk, number))
            transfer.next_chunk += number
            if transfer not in self._held:
                self._held.append(transfer)
        return Move(parts, demand)

    def _settle(self, moved: list[tuple[Move, dict[Transfer, BaseException]]]) -> None:
        """Under the lock: the busy time; each transfer of the moves completed advanced, and those with no
        chunk in flight any more failed, landed or put back in the queue (whatever ranks ahead now goes first)."""
        if not moved:
            return
        now = time.perf_counter()
        self._busy(now - self._busy_since, self._stretches)
        self._busy_since, self._stretches = now, 0
        for move, errors in moved:
            self._demand_moves -= move.demand
            if self.timeline is not None:
                self.timeline.add(self.name, _label(move), move.began_s, now)
            for transfer, _, count in move.parts:
                transfer.settled += count
                if transfer.error is None:
                    transfer.error = errors.get(transfer)
                if not transfer.moving:
                    self._release(transfer)

    def _release(self, transfer: Transfer) -> None:
        self._held.remove(transfer)
        if transfer.error is not None:
            self._failed(transfer, transfer.error)
        elif transfer.settled == len(transfer.chunks):
            self._landed(transfer)
        else:
            self._queue.push(transfer, new=False)


def _label(move: Move) -> str:
    experts = " ".join(f"{t.key.layer}/{t.key.expert}" for t, _, _ in move.parts)
    return f"{'demand' if move.demand else 'speculative'} {experts}"


class DiskWorker(LinkWorker):
    """The disk link's I/O thread; it reads its moves on max_chunks threads of its own (see the module doc)."""

    name = "disk"

    def __init__(self, cond: threading.Condition, queue: TransferQueue,
                 read: Callable[[Sequence[tuple[Sequence[Segment], torch.Tensor]]], int],
                 landed: Callable[[Transfer], None], failed: Callable[[Transfer, BaseException], None],
                 busy: Callable[[float, int], None], max_chunks: int = MAX_CHUNKS_IN_FLIGHT):
        super().__init__(cond, queue, landed, failed, busy, max_chunks)
        self._read = read
        self._readers = futures.ThreadPoolExecutor(max_chunks, thread_name_prefix=f"moestream-{self.name}-read")
        self.start()

    def _close(self) -> None:
        self._readers.shutdown(wait=True)

    def _issue(self, move: Move) -> futures.Future:
        """The move's chunks read together, by one of the reading threads."""
        return self._readers.submit(self._read, [(chunk.segments, chunk.dst) for chunk in move.chunks()])

    def _wait(self, flight: list[tuple[Move, futures.Future]]) -> list[tuple[Move, dict[Transfer, BaseException]]]:
        """Waits for the first read to complete (one failed read fails every transfer of its move)."""
        done, _ = futures.wait([read for _, read in flight], return_when=futures.FIRST_COMPLETED)
        moved = [(move, read.exception()) for move, read in flight if read in done]
        flight[:] = [(move, read) for move, read in flight if read not in done]
        for move, error in moved:
            if error is not None:  # handed to the threads that wait on these experts
                log.debug("a disk read of %d chunks failed: %s", len(move.chunks()), error)
        return [(move, {} if error is None else {t: error for t, _, _ in move.parts}) for move, error in moved]
