"""The expert store with transfers beside compute: prefetch queues, fetch waits only for what it lacks.

`AsyncExpertStore` keeps the residency, budgets and counters of `ExpertStore` and moves bytes on
link workers instead of the caller's thread; its links follow its tiers. A device tier alone has
one link, disk -> device (`moestream.store.transfer`): on the CPU each expert is read straight into
its slot; on CUDA the worker reads each chunk into one pinned staging slot, copies it up on the
link's copy stream and waits for that copy's event (on the worker thread: the compute stream and
the device are never synchronised) before the next chunk reuses the staging slot. With a host tier
kept apart (CUDA: pinned host slots below GPU memory) a second link follows, host -> device
(`moestream.store.copier`): a host hit goes straight to its queue; a miss is read into a host slot,
checked there (integrity), then re-queued on it with its demand and priority, so that one expert's
read overlaps another's copy up. The host tier keeps the copy and evicts by its own policy; a host
slot stays pinned while the disk writes it and while the copy reads it. A demand miss that finds
every host slot pinned waits for a copy; a speculative one is refused (it leaves the device tier:
the one residency rule here that still depends on the clock). `open_store`
(`moestream.store.factory`) picks the store for a configuration.

Residency is the transfer core's (`moestream.transfer_core`): an expert is in the device tier from
its admission, whether its bytes have landed or not; this store only moves them. Life of a transfer:
queued (in flight: `in_flight()`, until its bytes are in the device slot), then landed, or failed
(the expert leaves the tier, the error kept for the thread that waits on it). `fetch` is the early
preemption: the layer's misses go to the head of the queue in the order asked, its in-flight
experts become demand in whichever queue holds them, and the queued speculative transfers of its
layers that the gate did not choose go to the back. A transfer whose expert the core evicts
(`_displaced`) is cancelled if queued (a cancelled read frees its host slot, a cancelled copy keeps
the host copy), else waited for before its slot is reused. Every wait has a timeout
(`StoreConfig.transfer_timeout_s`). Knows no policy and no device type: the `Link` decides how
bytes move up.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.errors import CheckpointError
from moestream.policies.contracts import EvictionPolicy, TransferRequest
from moestream.store.config import StoreConfig
from moestream.store.fetch import Fetch
from moestream.store.disk import DiskReader
from moestream.store.pool import SlotPool
from moestream.store.store import ExpertStore, Tier, _key, staging_slots
from moestream.store.streams import Link
from moestream.store.copier import CopyWorker, copy_chunks
from moestream.store.transfer import (DISK, H2D, DiskWorker, LinkReports, Transfer, TransferError, TransferQueue,
                                      chunks_of)
from moestream.topology import ExpertKey

STOP_TIMEOUT_S = 30.0  # close() waits this long for the worker to finish its chunk


class AsyncExpertStore(ExpertStore):
    def __init__(self, index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
                 host_eviction: EvictionPolicy, integrity: Integrity | None = None, reader=None, link=None,
                 staging: int | None = None, tracer=None):
        """As ExpertStore; staging: 1 for the disk worker's one staging slot (default: where `staging_slots`
        wants any), 0 for none."""
        staging = staging_slots(config, index.topology, 1) if staging is None else min(staging, 1)
        super().__init__(index, config, device_eviction, host_eviction, integrity, reader, link, staging, tracer)
        self._cond = threading.Condition(self._lock)
        self._queue = TransferQueue(self.device_slots)
        self._errors: dict[ExpertKey, TransferError] = {}
        self._closed = False
        self._copies = TransferQueue(self.device_slots)  # the host -> device link's, with a host tier
        self._stale: set[ExpertKey] = set()  # host slots a dropped read still writes
        reports = LinkReports(landed=self._landed, failed=self._failed, busy=self._link_read,
                              released=self._given_back)
        def read(batch) -> int:  # self.reader, as callers may have wrapped it since
            return read_chunks(self.reader, batch, self._bounce, self._link)

        self._workers = [DiskWorker(self._cond, self._queue, read, reports, config.chunks_in_flight)]
        if self._host is not None:  # disk -> host -> device: a second link after the first
            reports = LinkReports(landed=self._copied, failed=self._copy_failed, busy=self._link_copied,
                                  released=self._given_back)
            self._workers.append(CopyWorker(self._cond, self._copies, self._link, reports, config.chunks_in_flight))
        for worker in self._workers:
            worker.timeline = tracer

    # -- compute thread --------------------------------------------------------------------------

    def fetch(self, keys: Sequence[ExpertKey], chosen: Sequence[ExpertKey] = ()) -> Fetch:
        """chosen: every expert the gate chose in these layers (default: keys), which preemption keeps."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        with self._lock:
            self._check_open()
            self._check_fits(wanted)
            self._defer(wanted, {_key(k) for k in chosen} | set(wanted))
            late, missed = self._core.fetch_layer(wanted)  # pinned until release
            for key in late:  # on its way: promoted to demand (unless it failed meanwhile: next_ready raises)
                transfer = self._core.moving.get(key)
                if transfer is not None:
                    self._queue_of(transfer).reprioritise(transfer, demand=True)
            queued = 0
            try:
                for key in missed:
                    self._enqueue(key, 0.0, demand=True)
                    queued += 1
            except BaseException:
                for key in missed[queued:]:
                    self._core.forget(key)
                self._device.cache.unpin(wanted)
                raise
        return Fetch(self, wanted)

    def acquire(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """Returns once every key's bytes are in place (fetch, then wait for all)."""
        fetch = self.fetch(keys)
        try:
            return dict(fetch.ready())
        except BaseException:
            fetch.release()
            raise

    def next_ready(self, candidates: Sequence[ExpertKey]) -> tuple[ExpertKey, torch.Tensor]:
        """The first candidate whose bytes are in place (waiting for one to land), with its slot."""
        deadline = time.perf_counter() + self.config.transfer_timeout_s
        with self._cond:
            while True:
                for key in candidates:
                    if key in self._errors:
                        raise self._errors.pop(key)
                    if key not in self._core.moving:
                        return key, self._slot_of(self._device, key)
                began = time.perf_counter()
                try:
                    self._wait(deadline, f"experts {[tuple(k) for k in candidates]}")
                finally:
                    self._waited(began, candidates)

    def prefetch(self, requests: Sequence[TransferRequest]) -> list[ExpertKey]:
        """Admits the requested experts by priority and queues their transfers; returns at once."""
        with self._lock:
            self._check_open()
            priorities = {_key(r.key): r.priority for r in requests}
            brought = self._admit_prefetches(requests)
            for key in priorities.keys() - set(brought):
                if key in self._core.moving:  # under way already: its rank follows the new plan
                    transfer = self._core.moving[key]
                    self._queue_of(transfer).reprioritise(transfer, priority=priorities[key])
            brought = [key for key in brought if self._enqueue(key, priorities[key], demand=False)]
            self._stats.prefetched += len(brought)
            self._stats.prefetched_bytes += len(brought) * self.topology.expert_bytes
        return brought

    def wait_idle(self) -> None:
        """Blocks until no transfer is in flight (e.g. after a preload); raises the first failure."""
        deadline = time.perf_counter() + self.config.transfer_timeout_s
        with self._cond:
            while self._core.moving:
                self._wait(deadline, f"{len(self._core.moving)} transfers in flight")
            if self._errors:
                error = next(iter(self._errors.values()))
                self._errors.clear()
                raise error

    def in_flight(self) -> frozenset[ExpertKey]:
        """Experts admitted whose bytes are queued or being read."""
        with self._lock:
            return frozenset(self._core.moving)

    def resident(self, tier: str = "device") -> frozenset[ExpertKey]:
        """Experts whose bytes are in place in the tier (those still arriving there excluded)."""
        with self._lock:
            return super().resident(tier) - self._arriving(tier)

    def close(self) -> None:
        """Stops the worker after its current chunk, drops the queued transfers, closes the files."""
        with self._lock:
            self._closed = True
        for worker in reversed(self._workers):  # the host -> device link's first
            worker.stop(STOP_TIMEOUT_S)
        with self._cond:
            for transfer in list(self._core.moving.values()):
                self._forget(transfer)
            self._queue.drain()
            self._cond.notify_all()
        super().close()

    # -- under the lock --------------------------------------------------------------------------

    def _arriving(self, tier: str) -> set[ExpertKey]:
        """Experts admitted to the tier whose bytes are still on their way there."""
        if tier == "host":
            return {key for key, t in self._core.moving.items() if t.link == DISK}
        return set(self._core.moving)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the expert store is closed")

    def _defer(self, wanted: list[ExpertKey], chosen: set[ExpertKey]) -> None:
        """Queued speculative transfers of the wanted experts' layers that the gate did not choose go
        to the back of the queue (their experts keep their slots)."""
        layers = {k.layer for k in wanted}
        for transfer in self._speculative():
            if transfer.key.layer in layers and transfer.key not in chosen:
                self._queue_of(transfer).reprioritise(transfer, priority=float("-inf"))

    def _enqueue(self, key: ExpertKey, priority: float, demand: bool) -> bool:
        """Queues the transfer of an expert just admitted (and pinned); False: refused (it left the tier).
        With a host tier, a host hit goes to the copy queue; a miss takes a host slot and goes to the disk queue."""
        self._errors.pop(key, None)
        if self._host is None:
            self._queue_read(key, self._slot_of(self._device, key), priority, demand)
            return True
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

    def _queue_read(self, key: ExpertKey, slot: torch.Tensor, priority: float, demand: bool) -> None:
        """Queues the disk read of key's bytes into slot (1-D uint8)."""
        transfer = Transfer(key, chunks_of(self.index.locations[key].segments, slot, self.config.chunk_bytes),
                            priority=priority, demand=demand)
        self._queue.push(transfer)
        self._core.track(key, transfer)
        self._cond.notify_all()

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
        """Queued speculative transfers (not those a worker holds), lowest priority first."""
        return sorted(self._queue.speculative() + self._copies.speculative(), key=lambda t: t.priority)

    def _queue_of(self, transfer: Transfer) -> TransferQueue:
        return self._copies if transfer.link == H2D else self._queue

    def _displaced(self, transfer: Transfer) -> None:
        """The core evicted the transfer's expert: cancelled if queued, else moved no further once its
        worker's round ends. Its slot is safe to reuse at once: whatever is queued into it next goes
        on the same link's worker, after that round."""
        if transfer.link == DISK and transfer.held and self._host is not None:
            self._stale.add(transfer.key)  # not a host hit until the read lets go of its slot
        transfer.dropped = True
        if self._queue_of(transfer).cancel(transfer.key) is transfer:
            self._stats.cancelled += 1
            self._given_back(transfer)
        elif not transfer.held:  # between the stages of a tiered transfer: nothing holds it
            self._given_back(transfer)

    def _given_back(self, transfer: Transfer) -> None:
        """What a transfer held besides its device slot, given back: a copy's host pin (its host copy
        stays); a dropped read's expert leaves the host tier (its bytes may not be whole) unless a new
        read fills it again."""
        key = transfer.key
        if self._host is None:
            return
        if transfer.link == H2D:
            self._host.cache.unpin([key])
            return
        self._stale.discard(key)
        if key in self._core.moving:
            self._host.cache.unpin([key])
        elif key in self._host.cache:
            self._host.cache.remove(key)

    def _forget(self, transfer: Transfer) -> None:
        """The transfer's expert leaves the device tier (its bytes never arrived there)."""
        self._core.forget(transfer.key)
        self._given_back(transfer)

    def _wait(self, deadline: float, what: str) -> None:
        self._check_open()
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TransferError(f"timed out after {self.config.transfer_timeout_s:g} s waiting for {what}")
        self._cond.wait(left)

    # -- worker callbacks ------------------------------------------------------------------------

    def _link_read(self, seconds: float) -> None:  # under the lock: one read of chunks in flight together
        self._stats.transfer_s += seconds
        self._stats.disk_read_s += seconds
        self._stats.disk_batches += 1

    def _landed(self, transfer: Transfer) -> None:  # under the lock: the bytes are in the read's slot
        if not self._verified(transfer, self._host or self._device):
            return
        self._stats.host_misses += 1
        if self._host is not None:  # on to the host -> device link, with its demand and priority
            self._queue_copy(transfer.key, transfer.priority, transfer.demand, continued=True)
            return
        self._core.landed(transfer.key, transfer)
        self._cond.notify_all()

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

    def _verified(self, transfer: Transfer, tier: Tier) -> bool:  # under the lock
        """Whether a landed transfer is still wanted and its bytes in tier's slot pass the integrity
        check (if not, the transfer has failed)."""
        if self._core.moving.get(transfer.key) is not transfer:
            return False  # displaced, or forgotten by close()
        try:
            self._arrived([transfer.key], [self._slot_of(tier, transfer.key)])
        except CheckpointError as error:
            self._failed(transfer, error)
            return False
        return True

    def _failed(self, transfer: Transfer, error: BaseException) -> None:  # under the lock
        self._fail(transfer, error, f"reading expert {tuple(transfer.key)} from disk failed")

    def _fail(self, transfer: Transfer, error: BaseException, what: str) -> None:  # under the lock
        """The error kept for the thread that waits on the transfer's expert, which leaves the tier."""
        if self._core.moving.get(transfer.key) is transfer:
            failure = error if isinstance(error, CheckpointError) else TransferError(f"{what}: {error}")
            failure.__cause__ = None if failure is error else error
            self._errors[transfer.key] = failure
            self._forget(transfer)
        self._cond.notify_all()


def read_chunks(reader: DiskReader, batch, staging: SlotPool, link: Link) -> int:
    """The disk link's copy function (on its worker, outside the lock): the chunks read into their slots
    together, or, with a staging slot, one by one through it and up the link."""
    if not staging.num_slots:
        return reader.read_batch(batch)
    got = 0
    for segments, dst in batch:
        slot = staging.slot(0, segments[0].offset)[: dst.numel()]  # [chunk bytes], pinned, congruent
        got += reader.read_batch([(segments, slot)])
        link.copy(dst, slot).synchronize()  # the copy stream's event, before the slot is reused
    return got
