"""Asynchronous expert transfers: a re-prioritisable, cancellable queue and the I/O worker of the disk link.

A `Transfer` moves one expert's bytes from the checkpoint's files into its slot, chunk by chunk
(one chunk per weight matrix, or pieces of at most `chunk_bytes`). The `TransferQueue` orders
transfers: demand transfers (the compute thread waits on them) first, in the order asked, then
speculative ones by priority. Requests are re-prioritised and cancelled by key, and the queue never
holds more transfers than it was sized for. The `DiskWorker` thread takes the head transfer, reads
one chunk, and puts the transfer back whenever another one now ranks ahead of it, so that a demand
miss waits at most one chunk behind speculative work.

Queue and worker share the store's condition: every change of the queue happens under its lock, and
the worker reads outside it. The worker reports each finished or failed transfer through the two
callbacks it is given; it knows no eviction, no policy and no tier.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from moestream.checkpoint.layout import Segment
from moestream.errors import MoestreamError
from moestream.topology import ExpertKey

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle worker sleeps before it checks for stop again


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
    busy_s: float = 0.0  # time the link spent reading this transfer

    @property
    def rank(self) -> tuple:
        return (0, self.order) if self.demand else (1, -self.priority, self.order)

    @property
    def done(self) -> bool:
        return self.next_chunk >= len(self.chunks)


def chunks_of(segments: Sequence[Segment], slot: torch.Tensor, chunk_bytes: int) -> list[Chunk]:
    """The slot's fill as chunks: one per segment (weight matrix), or pieces of <= chunk_bytes (> 0)."""
    chunks, at = [], 0
    for seg in segments:
        step = seg.nbytes if chunk_bytes <= 0 else chunk_bytes
        for start in range(0, seg.nbytes, step):
            n = min(step, seg.nbytes - start)
            chunks.append(Chunk((Segment(seg.file, seg.offset + start, n),), slot[at : at + n]))
            at += n
    return chunks


@dataclass
class TransferQueue:
    """Pending transfers by rank, with lazy deletion; at most `capacity` of them."""

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
        heapq.heappush(self._heap, (transfer.rank, transfer.order, transfer))

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
            heapq.heappush(self._heap, (transfer.rank, transfer.order, transfer))

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


class DiskWorker:
    """The disk link's one I/O thread (see the module doc)."""

    def __init__(self, cond: threading.Condition, queue: TransferQueue,
                 read: Callable[[Sequence[tuple[Sequence[Segment], torch.Tensor]]], int],
                 landed: Callable[[Transfer], None], failed: Callable[[Transfer, BaseException], None]):
        self._cond, self._queue, self._read = cond, queue, read
        self._landed, self._failed = landed, failed
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moestream-disk-link", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TransferError(f"the disk worker did not stop within {timeout_s:g} s")

    def _run(self) -> None:
        transfer = None
        while True:
            with self._cond:
                transfer = self._next(transfer)
                if transfer is None:
                    return
            self._step(transfer)

    def _next(self, current: Transfer | None) -> Transfer | None:
        """The transfer to read a chunk of next (the current one unless another ranks ahead); None: stop."""
        if self._stopping:
            return None
        if current is not None and not current.done:
            head = self._queue.head_rank()
            if head is None or head >= current.rank:
                return current
            self._queue.push(current, new=False)
        while not self._stopping:
            transfer = self._queue.pop()
            if transfer is not None:
                return transfer
            self._cond.wait(IDLE_WAIT_S)
        return None

    def _step(self, transfer: Transfer) -> None:
        chunk = transfer.chunks[transfer.next_chunk]
        began = time.perf_counter()
        try:
            self._read([(chunk.segments, chunk.dst)])
        except BaseException as error:  # handed to the thread that waits on this expert
            log.debug("transfer of expert %s failed: %s", tuple(transfer.key), error)
            with self._cond:
                self._account(transfer, began)
                transfer.next_chunk = len(transfer.chunks)
                self._failed(transfer, error)
            return
        with self._cond:
            self._account(transfer, began)
            transfer.next_chunk += 1
            if transfer.done:
                self._landed(transfer)

    @staticmethod
    def _account(transfer: Transfer, began: float) -> None:
        transfer.busy_s += time.perf_counter() - began
