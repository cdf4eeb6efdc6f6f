"""The asynchronous store with a host tier: one worker per link (disk -> host, host -> device), both at once.

`TieredAsyncStore` serves a device tier and a host tier between it and disk (on CUDA: pinned host
slots below GPU memory). A device miss whose expert is in the host tier goes straight to the host
-> device link's queue (`moestream.store.copier`); any other is read by the disk worker
(`moestream.store.transfer`) into a host slot, checked there (integrity), then re-queued on the host
-> device link with its demand and priority (tier pipelining), so that one expert's read overlaps
another's copy up. The host tier keeps the copy and evicts by its own policy, as in the synchronous
store. A host slot is pinned while the disk writes it and while the host -> device link reads it,
so that no eviction reuses it before that copy is done.

Preemption, cancellation, timeouts and failures keep their meaning across both stages: an expert
is in flight (`in_flight()`) from its admission to the device tier until its bytes are in its
device slot; a demand reorders it in whichever queue holds it; a queued speculative transfer is
cancelled in either queue (a cancelled read frees its host slot, a cancelled copy keeps the host
copy); a failed read or copy surfaces to the thread that waits on the expert. A demand miss that
finds every host slot pinned waits for a copy to finish; a speculative one is refused instead (it
leaves the device tier: the one residency rule here that still depends on the clock). This store knows no policy and no device type: the `Link`
decides how bytes move up (a plain copy on the CPU, a copy stream and its events on CUDA).
"""

from __future__ import annotations

import time

from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.policies.contracts import EvictionPolicy
from moestream.store.async_store import STOP_TIMEOUT_S, AsyncExpertStore
from moestream.store.config import StoreConfig
from moestream.store.copier import CopyWorker, copy_chunks
from moestream.store.transfer import DISK, H2D, LinkReports, Transfer, TransferQueue
from moestream.timeline import Timeline
from moestream.topology import ExpertKey


class TieredAsyncStore(AsyncExpertStore):
    def __init__(self, index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
                 host_eviction: EvictionPolicy, integrity: Integrity | None = None, reader=None, link=None):
        if not config.host_slots(index.topology):
            raise ValueError("the tiered asynchronous store needs a host tier of at least one expert")
        super().__init__(index, config, device_eviction, host_eviction, integrity, reader=reader, link=link)
        self._copies = TransferQueue(self.device_slots)
        reports = LinkReports(landed=self._copied, failed=self._copy_failed, busy=self._link_copied,
                              released=self._given_back)
        self._stale: set[ExpertKey] = set()  # host slots a dropped read still writes
        self._copier = CopyWorker(self._cond, self._copies, self._link, reports, config.chunks_in_flight)

    # -- under the lock --------------------------------------------------------------------------

    def _enqueue(self, key: ExpertKey, priority: float, demand: bool) -> bool:
        """A host hit goes to the copy queue; a miss takes a host slot and goes to the disk queue."""
        self._errors.pop(key, None)
        if key not in self._stale and self._host.cache.access(key) is not None:
            self._stats.host_hits += 1
            self._host.cache.pin([key])  # the copy's pin
            self._queue_copy(key, priority, demand)
            return True
        if not self._host_room(demand):
            self._core.forget(key)
            return False
        slot, victim = self._host.cache.admit(key)
        self._stats.evictions["host"] += victim is not None
        self._host.cache.pin([key])  # the read's pin, then the copy's
        self._queue_read(key, self._host.pool.slot(slot, self._residues[key]), priority, demand)
        return True

    def _queue_copy(self, key: ExpertKey, priority: float, demand: bool, continued: bool = False) -> None:
        src, dst = self._slot_of(self._host, key), self._slot_of(self._device, key)
        chunks = copy_chunks(self.index.locations[key].segments, src, dst, self.config.chunk_bytes)
        copy = Transfer(key, chunks, priority=priority, demand=demand, continued=continued, link=H2D)
        self._copies.push(copy)
        self._core.track(key, copy)
        self._cond.notify_all()

    def _host_room(self, demand: bool) -> bool:
        """Whether the host tier can take one more expert; a demand waits for a copy to free one."""
        deadline = time.perf_counter() + self.config.transfer_timeout_s
        while len(self._host.cache) >= self.host_slots and not self._host.cache.has_evictable():
            if not demand:
                return False
            self._wait(deadline, "a free host slot")
        return True

    def _speculative(self) -> list[Transfer]:
        return sorted(self._queue.speculative() + self._copies.speculative(), key=lambda t: t.priority)

    def _queue_of(self, transfer: Transfer) -> TransferQueue:
        return self._copies if transfer.link == H2D else self._queue

    def _arriving(self, tier: str) -> set[ExpertKey]:
        if tier == "host":
            return {key for key, t in self._core.moving.items() if t.link == DISK}
        return super()._arriving(tier)

    def _displaced(self, transfer: Transfer) -> None:
        if transfer.link == DISK and transfer.held:
            self._stale.add(transfer.key)  # not a host hit until the read lets go of its slot
        super()._displaced(transfer)

    def _given_back(self, transfer: Transfer) -> None:
        """A dropped read's expert leaves the host tier (its bytes may not be whole) unless a new read
        fills it again; a copy's stays there."""
        key = transfer.key
        if transfer.link == H2D:
            self._host.cache.unpin([key])
            return
        self._stale.discard(key)
        if key in self._core.moving:
            self._host.cache.unpin([key])
        elif key in self._host.cache:
            self._host.cache.remove(key)

    def record_timeline(self, timeline: Timeline | None) -> None:
        super().record_timeline(timeline)
        self._copier.timeline = timeline

    def _stop_workers(self) -> None:
        self._copier.stop(STOP_TIMEOUT_S)
        super()._stop_workers()

    # -- worker callbacks ------------------------------------------------------------------------

    def _landed(self, transfer: Transfer) -> None:  # under the lock: the bytes are in the host slot
        if not self._verified(transfer, self._host):
            return
        self._stats.host_misses += 1
        self._queue_copy(transfer.key, transfer.priority, transfer.demand, continued=True)

    def _copied(self, copy: Transfer) -> None:  # under the lock: the bytes are in the device slot
        if not self._core.landed(copy.key, copy):
            return  # displaced, or forgotten by close()
        self._host.cache.unpin([copy.key])
        self._stats.bytes_read["host"] += self.topology.expert_bytes
        self._cond.notify_all()

    def _copy_failed(self, copy: Transfer, error: BaseException) -> None:  # under the lock
        self._fail(copy, error, f"copying expert {tuple(copy.key)} from host to device failed")

    def _link_copied(self, seconds: float) -> None:  # under the lock
        self._stats.copy_s += seconds
