"""The expert store with transfers beside compute: prefetch queues, fetch waits only for what it lacks.

`AsyncExpertStore` keeps the residency, budgets and counters of `ExpertStore` and moves bytes on
the disk link's worker (`moestream.store.transfer`) instead of the caller's thread. It serves a
device tier with no host tier. On the CPU that is one tier, each expert held once, read straight
from disk into its slot. On CUDA the worker reads each chunk into one pinned staging slot, copies
it up on the link's copy stream and waits for that copy's event (on the worker thread: the compute
stream and the device are never synchronised) before the next chunk reuses the staging slot.
`open_store` picks this store when the configuration asks for asynchronous transfers and there is
no host tier, else the synchronous store.

Life of an expert: admitted to a slot and pinned by its transfer (in flight: `in_flight()`), then
landed (unpinned, resident), or cancelled while queued (slot freed), or failed (slot freed, the
error kept for the thread that waits on it). `fetch` is the early preemption: the layer's misses go
to the head of the queue in the order asked, its in-flight experts become demand, and the queued
speculative transfers of its layers that the gate did not choose are dropped. A demand miss that
finds every slot pinned cancels queued speculative transfers, lowest priority first, then waits for
an in-flight one to land. Every wait has a timeout (`StoreConfig.transfer_timeout_s`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import torch

from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.errors import CheckpointError
from moestream.policies.contracts import EvictionPolicy, TransferRequest
from moestream.store.config import Budget, StoreConfig
from moestream.store.fetch import Fetch
from moestream.store.store import ExpertStore, _key
from moestream.store.transfer import DiskWorker, Transfer, TransferError, TransferQueue, chunks_of
from moestream.topology import ExpertKey

STOP_TIMEOUT_S = 30.0  # close() waits this long for the worker to finish its chunk


def open_store(index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
               host_eviction: EvictionPolicy, integrity: Integrity | None = None) -> ExpertStore:
    """The asynchronous store when asked for and the tiers allow it, else the synchronous one.

    On the CPU, host and device memory are the same: an asynchronous store there is one tier whose
    budget is the two budgets together, each expert held once."""
    if config.asynchronous and not config.uses_cuda:
        config = one_tier(config, index.topology)
    kind = AsyncExpertStore if config.asynchronous and config.host_slots(index.topology) == 0 else ExpertStore
    return kind(index, config, device_eviction, host_eviction, integrity)


def one_tier(config: StoreConfig, topology) -> StoreConfig:
    """The configuration with the host budget moved into the device tier."""
    host_bytes = config.host_budget.resolve(topology.total_expert_bytes)
    if not host_bytes:
        return config
    device_bytes = config.device_budget.resolve(topology.total_expert_bytes)
    return dataclasses.replace(config, device_budget=Budget(size_bytes=device_bytes + host_bytes),
                               host_budget=Budget(size_bytes=0))


class AsyncExpertStore(ExpertStore):
    bounce_slots = 1  # the disk worker's staging slot where the device tier is not host memory

    def __init__(self, index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
                 host_eviction: EvictionPolicy, integrity: Integrity | None = None):
        super().__init__(index, config, device_eviction, host_eviction, integrity)
        if self._host is not None:
            raise ValueError("the asynchronous store serves a device tier without a host tier")
        self._cond = threading.Condition(self._lock)
        self._queue = TransferQueue(self.device_slots)
        self._pending: dict[ExpertKey, Transfer] = {}
        self._errors: dict[ExpertKey, TransferError] = {}
        self._closed = False
        self._worker = DiskWorker(self._cond, self._queue, self._read_chunks, self._landed, self._failed,
                                  self._link_read)

    # -- compute thread --------------------------------------------------------------------------

    def fetch(self, keys: Sequence[ExpertKey], chosen: Sequence[ExpertKey] = ()) -> Fetch:
        """chosen: every expert the gate chose in these layers (default: keys), which preemption keeps."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        with self._lock:
            self._check_open()
            self._check_fits(wanted)
            self._preempt(wanted, {_key(k) for k in chosen} | set(wanted))
            pinned: list[ExpertKey] = []
            try:
                for key in wanted:
                    self._demand(key)
                    self._device.pin([key])
                    pinned.append(key)
            except BaseException:
                self._device.unpin(pinned)
                raise
        return Fetch(self, wanted)

    def acquire(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """As ExpertStore.acquire: returns once every key's bytes are in place."""
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
                    if key not in self._pending:
                        return key, self._device_pool.slot(self._device.slot(key))
                began = time.perf_counter()
                try:
                    self._wait(deadline, f"experts {[tuple(k) for k in candidates]}")
                finally:
                    self._stats.stall_s += time.perf_counter() - began

    def prefetch(self, requests: Sequence[TransferRequest], max_evictions: int | None = None) -> list[ExpertKey]:
        """Admits the requested experts by priority and queues their transfers; returns at once."""
        with self._lock:
            self._check_open()
            priorities = {_key(r.key): r.priority for r in requests}
            brought, kept = self._admit_prefetches(requests, max_evictions)
            self._device.unpin(kept)
            for key in kept:
                if key in self._pending:
                    self._queue.reprioritise(self._pending[key], priority=priorities[key])
            for key in brought:  # each keeps the pin _admit_prefetches gave it until it lands
                self._enqueue(key, priorities[key], demand=False)
                self._unused_prefetches.add(key)
            self._stats.prefetched += len(brought)
            self._stats.prefetched_bytes += len(brought) * self.topology.expert_bytes
        return brought

    def wait_idle(self) -> None:
        """Blocks until no transfer is in flight (e.g. after a preload); raises the first failure."""
        deadline = time.perf_counter() + self.config.transfer_timeout_s
        with self._cond:
            while self._pending:
                self._wait(deadline, f"{len(self._pending)} transfers in flight")
            if self._errors:
                error = next(iter(self._errors.values()))
                self._errors.clear()
                raise error

    def in_flight(self) -> frozenset[ExpertKey]:
        """Experts admitted whose bytes are queued or being read."""
        with self._lock:
            return frozenset(self._pending)

    def resident(self, tier: str = "device") -> frozenset[ExpertKey]:
        """Experts whose bytes are in place (those in flight excluded)."""
        with self._lock:
            return super().resident(tier) - self._pending.keys()

    def close(self) -> None:
        """Stops the worker after its current chunk, drops the queued transfers, closes the files."""
        with self._lock:
            self._closed = True
        self._worker.stop(STOP_TIMEOUT_S)
        with self._cond:
            for transfer in list(self._pending.values()):
                self._forget(transfer)
            self._queue.drain()
            self._cond.notify_all()
        super().close()

    # -- under the lock --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the expert store is closed")

    def _pinned(self) -> set[ExpertKey]:
        """Experts pinned by callers; transfers' own pins do not count: they are cancelled or land."""
        return set(self._device.pinned()) - self._pending.keys()

    def _preempt(self, wanted: list[ExpertKey], chosen: set[ExpertKey]) -> None:
        """Drops queued speculative transfers of the wanted experts' layers that the gate did not choose."""
        layers = {k.layer for k in wanted}
        for transfer in self._queue.speculative():
            if transfer.key.layer in layers and transfer.key not in chosen:
                self._cancel(transfer)

    def _demand(self, key: ExpertKey) -> None:
        if self._hit(key):
            transfer = self._pending.get(key)
            if transfer is not None:
                self._stats.late += 1
                self._queue.reprioritise(transfer, demand=True)
            return
        self._stats.misses += 1
        self._make_room()
        self._admit(key)
        self._device.pin([key])  # the transfer's pin
        self._enqueue(key, 0.0, demand=True)

    def _make_room(self) -> None:
        """A full tier with nothing evictable: cancel queued speculative transfers, then wait for landings."""
        deadline = time.perf_counter() + self.config.transfer_timeout_s
        speculative = self._queue.speculative()
        while len(self._device) >= self.device_slots and not self._device.has_evictable():
            if speculative:
                self._cancel(speculative.pop(0))
            else:
                self._wait(deadline, "a free device slot")

    def _enqueue(self, key: ExpertKey, priority: float, demand: bool) -> None:
        self._errors.pop(key, None)
        slot = self._device_pool.slot(self._device.slot(key))
        transfer = Transfer(key, chunks_of(self.index.locations[key].segments, slot, self.config.chunk_bytes),
                            priority=priority, demand=demand)
        self._queue.push(transfer)
        self._pending[key] = transfer
        self._cond.notify_all()

    def _cancel(self, transfer: Transfer) -> None:
        if self._queue.cancel(transfer.key) is transfer:
            self._stats.cancelled += 1
            self._unused_prefetches.discard(transfer.key)
            self._forget(transfer)

    def _forget(self, transfer: Transfer) -> None:
        """The transfer's expert leaves the tier (its bytes never arrived)."""
        self._pending.pop(transfer.key, None)
        if transfer.key in self._device:
            self._device.remove(transfer.key)

    def _wait(self, deadline: float, what: str) -> None:
        self._check_open()
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TransferError(f"timed out after {self.config.transfer_timeout_s:g} s waiting for {what}")
        self._cond.wait(left)

    # -- worker callbacks ------------------------------------------------------------------------

    def _read_chunks(self, batch) -> int:
        """The worker's read of chunks (outside the lock): into their slots together, or staged one by one."""
        if not self._bounce.num_slots:
            return self._reader.read_batch(batch)
        got = 0
        for segments, dst in batch:
            staging = self._bounce.slot(0)[: dst.numel()]  # [chunk bytes], pinned
            got += self._reader.read_batch([(segments, staging)])
            self._link.copy(dst, staging).synchronize()  # the copy stream's event, before staging is reused
        return got

    def _link_read(self, seconds: float) -> None:  # under the lock: one read of chunks in flight together
        self._stats.transfer_s += seconds
        self._stats.disk_read_s += seconds
        self._stats.disk_batches += 1


    def _landed(self, transfer: Transfer) -> None:  # under the lock
        if self._pending.get(transfer.key) is not transfer:
            return  # forgotten by close()
        try:
            self._arrived([transfer.key], [self._device_pool.slot(self._device.slot(transfer.key))])
        except CheckpointError as error:
            self._failed(transfer, error)
            return
        del self._pending[transfer.key]
        self._device.unpin([transfer.key])
        self._stats.host_misses += 1
        self._cond.notify_all()

    def _failed(self, transfer: Transfer, error: BaseException) -> None:  # under the lock
        if self._pending.get(transfer.key) is transfer:
            failure = error if isinstance(error, CheckpointError) else TransferError(
                f"reading expert {tuple(transfer.key)} from disk failed: {error}")
            failure.__cause__ = None if failure is error else error
            self._errors[transfer.key] = failure
            self._forget(transfer)
        self._cond.notify_all()
