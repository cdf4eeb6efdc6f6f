"""The host -> device link's I/O worker: copies experts from their host slots up to their device slots.

A copy (a `Transfer` on the `H2D` link) is the second stage of a transfer in a two-tier store (disk ->
host slot, then host slot -> device slot), or the only one when the expert is in the host tier already. It is cut into
chunks as the disk read is (one per weight matrix, or pieces of at most `chunk_bytes`). The store
queues it in a `TransferQueue` of its own (demand first, in the order asked, then speculative by
priority). Each round the `CopyWorker` thread takes chunks from the head of that queue as the disk
worker does (`LinkWorker`: every demand copy whole; else up to max_chunks chunks), issues them all
on the store's `Link` (`moestream.store.streams`: a plain copy on the CPU, the link's copy stream on
CUDA), so that several are in flight at once, and waits on its own thread for the round's last
event (the stream runs them in order), so that the store may reuse a host slot once its copy is
reported; the compute stream and the device are never synchronised. A demand copy waits at most for
one round of chunks behind speculative work. The worker shares the store's condition as the disk
worker does; it knows no eviction, no policy and no tier.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from moestream.checkpoint.layout import Segment
from moestream.store.streams import Event, Link
from moestream.store.transfer import (H2D, MAX_CHUNKS_IN_FLIGHT, LinkReports, LinkWorker, Transfer, TransferQueue,
                                      pieces)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyChunk:
    src: torch.Tensor  # [nbytes] uint8 view of the host slot
    dst: torch.Tensor  # [nbytes] uint8 view of the device slot


def copy_chunks(segments: Sequence[Segment], src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int) -> list[CopyChunk]:
    """The copy of a host slot (laid out as the expert's segments) into a device slot, chunk by chunk."""
    return [CopyChunk(src[at : at + part.nbytes], dst[at : at + part.nbytes]) for part, at in pieces(segments, chunk_bytes)]


class CopyWorker(LinkWorker):
    """The host -> device link's one thread (see the module doc)."""

    name = H2D

    def __init__(self, cond: threading.Condition, queue: TransferQueue, link: Link, reports: LinkReports,
                 max_chunks: int = MAX_CHUNKS_IN_FLIGHT):
        super().__init__(cond, queue, reports, max_chunks)
        self._link = link
        self.start()

    def _step(self, held: list[tuple[Transfer, int]]) -> None:
        """Issues the held chunks' copies, then waits for the last one (a failed copy fails its expert)."""
        began, errors, last = time.perf_counter(), {}, None
        for copy, count in held:
            try:
                for chunk in copy.chunks[copy.next_chunk : copy.next_chunk + count]:
                    last = self._link.copy(chunk.dst, chunk.src)
            except BaseException as error:  # handed to the thread that waits on this expert
                log.debug("a host -> device copy of expert %s failed: %s", tuple(copy.key), error)
                errors[copy] = error
        errors.update(self._synchronize(last, held))
        with self._cond:
            self._finish(began, held, errors)

    @staticmethod
    def _synchronize(last: Event | None, held: list[tuple[Transfer, int]]) -> dict[Transfer, BaseException]:
        """Waits for the round's last copy (this event only); if that fails, so does every held copy."""
        try:
            if last is not None:
                last.synchronize()
        except BaseException as error:
            log.debug("waiting for %d host -> device copies failed: %s", len(held), error)
            return {copy: error for copy, _ in held}
        return {}
