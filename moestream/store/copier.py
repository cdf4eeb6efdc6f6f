"""The host -> device link's I/O worker: copies experts from their host slots up to their device slots.

A `HostCopy` is the second stage of a transfer in a two-tier store (disk -> host slot, then host
slot -> device slot), or the only one when the expert is in the host tier already. The store queues
it in a `TransferQueue` of its own (demand first, in the order asked, then speculative by
priority). The `CopyWorker` thread takes one copy at a time from the head of that queue, issues it
on the store's `Link` (`moestream.store.streams`: a plain copy on the CPU, the link's copy stream on
CUDA) and waits for that copy's event on its own thread, so that the store may reuse the host slot
once the copy is reported; the compute stream and the device are never synchronised. A demand copy
waits at most for one expert's copy behind speculative work. The worker shares the store's
condition as the disk worker does; it knows no eviction, no policy and no tier.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moestream.store.streams import Link
from moestream.store.transfer import IDLE_WAIT_S, LinkWorker, Transfer, TransferQueue

log = logging.getLogger(__name__)


@dataclass(eq=False)
class HostCopy(Transfer):
    """One expert's copy from its host slot to its device slot (it has no disk chunks)."""

    src: torch.Tensor | None = None  # [expert bytes] uint8 host slot
    dst: torch.Tensor | None = None  # [expert bytes] uint8 device slot


class CopyWorker(LinkWorker):
    """The host -> device link's one thread (see the module doc)."""

    name = "h2d"

    def __init__(self, cond: threading.Condition, queue: TransferQueue, link: Link,
                 landed: Callable[[Transfer], None], failed: Callable[[Transfer, BaseException], None],
                 busy: Callable[[float], None]):
        super().__init__(cond, queue, landed, failed, busy)
        self._link = link
        self.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                copy = self._take()
            if copy is None:
                return
            began = time.perf_counter()
            try:
                self._link.copy(copy.dst, copy.src).synchronize()  # this copy's event only
            except BaseException as error:  # handed to the thread that waits on this expert
                log.debug("a host -> device copy of expert %s failed: %s", tuple(copy.key), error)
                self._report(began, self._failed, copy, error)
                continue
            self._report(began, self._landed, copy)

    def _take(self) -> HostCopy | None:
        """The copy at the head of the queue (waiting for one); None: stop."""
        while not self._stopping:
            copy = self._queue.pop()
            if copy is not None:
                return copy
            self._cond.wait(IDLE_WAIT_S)
        return None

    def _report(self, began: float, callback: Callable, *args) -> None:
        with self._cond:
            self._busy(time.perf_counter() - began)
            callback(*args)
