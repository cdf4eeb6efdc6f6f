"""The host -> device link's I/O worker: copies experts from their host slots up to their device slots.

A `HostCopy` is the second stage of a transfer in a two-tier store (disk -> host slot, then host
slot -> device slot), or the only one when the expert is in the host tier already. It is cut into
chunks as the disk read is (one per weight matrix, or pieces of at most `chunk_bytes`). The store
queues it in a `TransferQueue` of its own (demand first, in the order asked, then speculative by
priority). The `CopyWorker` thread takes its moves as the disk worker does (`LinkWorker`: every
demand copy whole as one move, else one chunk of the speculative copy that ranks first), issues
them on the store's `Link` (`moestream.store.streams`: a plain copy on the CPU, the link's copy
stream on CUDA) and waits on its own thread for the oldest move's events, so that the store may
reuse a host slot and hand out a device slot once its copy is reported; the compute stream and the
device are never synchronised. A link runs its copies in the order issued, so the worker keeps two
moves in flight: one copying and one queued behind it, so that the link does not wait for the host
between chunks, and a demand copy queued meanwhile is issued as soon as the first completes, behind
at most the one chunk queued ahead of it. The worker shares the store's condition as the disk
worker does; it knows no eviction, no policy and no tier.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moestream.checkpoint.layout import Segment
from moestream.store.streams import Event, Link
from moestream.store.transfer import LinkWorker, Move, Transfer, TransferQueue, pieces

log = logging.getLogger(__name__)

COPIES_IN_FLIGHT = 2  # moves issued on the link at once: one copying, one queued behind it


@dataclass(frozen=True)
class CopyChunk:
    src: torch.Tensor  # [nbytes] uint8 view of the host slot
    dst: torch.Tensor  # [nbytes] uint8 view of the device slot


@dataclass(eq=False)
class HostCopy(Transfer):
    """One expert's copy from its host slot to its device slot, as CopyChunks."""


def copy_chunks(segments: Sequence[Segment], src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int) -> list[CopyChunk]:
    """The copy of a host slot (laid out as the expert's segments) into a device slot, chunk by chunk."""
    return [CopyChunk(src[at : at + part.nbytes], dst[at : at + part.nbytes])
            for part, at in pieces(segments, chunk_bytes)]


class CopyWorker(LinkWorker):
    """The host -> device link's one thread (see the module doc)."""

    name = "h2d"

    def __init__(self, cond: threading.Condition, queue: TransferQueue, link: Link,
                 landed: Callable[[Transfer], None], failed: Callable[[Transfer, BaseException], None],
                 busy: Callable[[float, int], None], max_chunks: int = COPIES_IN_FLIGHT):
        super().__init__(cond, queue, landed, failed, busy, max_chunks)
        self._link = link
        self.start()

    def _issue(self, move: Move) -> tuple[list[Event], dict[Transfer, BaseException]]:
        """Issues the move's copies; a copy that fails to issue fails its expert, the others go on."""
        events, errors = [], {}
        for copy, first, count in move.parts:
            try:
                for chunk in copy.chunks[first : first + count]:
                    events.append(self._link.copy(chunk.dst, chunk.src))
            except BaseException as error:  # handed to the thread that waits on this expert
                log.debug("a host -> device copy of expert %s failed: %s", tuple(copy.key), error)
                errors[copy] = error
        return events, errors

    def _wait(self, flight: list[tuple[Move, tuple[list[Event], dict[Transfer, BaseException]]]]
              ) -> list[tuple[Move, dict[Transfer, BaseException]]]:
        """Waits for the oldest move's copies (each of its events); if that fails, so does each of its copies."""
        move, (events, errors) = flight.pop(0)
        try:
            for event in events:
                event.synchronize()
        except BaseException as error:
            log.debug("waiting for %d host -> device copies failed: %s", len(events), error)
            errors = {copy: error for copy, _, _ in move.parts}
        return [(move, errors)]
