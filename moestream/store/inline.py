"""The synchronous expert store (`--sync`): every transfer runs on the caller's thread, inline.

`acquire` makes experts resident in the device tier and pins them until `release`; a device miss
is served from the host tier when it holds the expert (one host->device copy), else from disk into
a host slot and on to the device (the host tier keeps the copy), or from disk straight into the
device slot when the host tier has no slots (on CUDA through pinned bounce slots). `prefetch`
brings requested experts in by priority without ever evicting a pinned expert. Each call admits
all its misses first and then reads them from disk as one batch, so that the disk reader keeps
their requests in flight together. Calls return once the bytes are in place, so no plan's request
is ever left unstarted and nothing is ever in flight between calls; stall_s and transfer_s are
both the time spent moving bytes on the caller's thread. Knows no policy and no model family.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.policies.contracts import EvictionPolicy, TransferRequest
from moestream.store.config import StoreConfig
from moestream.store.fetch import Fetch
from moestream.store.pool import SlotPool
from moestream.store.store import ExpertStore, _key, staging_slots
from moestream.tracer import expert_names
from moestream.topology import ExpertKey

BOUNCE_SLOTS = 8  # pinned staging slots between disk and a CUDA device tier when there is no host tier


class InlineStore(ExpertStore):
    def __init__(self, index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
                 host_eviction: EvictionPolicy, integrity: Integrity | None = None, reader=None, link=None,
                 staging: int | None = None, tracer=None):
        """As ExpertStore; staging: bounce slots (default: BOUNCE_SLOTS where `staging_slots` wants any)."""
        staging = staging_slots(config, index.topology, BOUNCE_SLOTS) if staging is None else staging
        super().__init__(index, config, device_eviction, host_eviction, integrity, reader, link, staging, tracer)

    def acquire(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """Make keys resident in the device tier and pin them; returns their 1-D uint8 slots.

        The misses are admitted first, then their bytes are brought in together (one batch of disk reads)."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        with self._lock:
            self._check_fits(wanted)
            _, misses = self._core.fetch_layer(wanted)  # pinned; nothing moves between calls: none is late
            try:
                self._timed_load(misses)
            except BaseException:
                self._device.cache.unpin(wanted)
                self._discard(misses)
                raise
            return {key: self._slot_of(self._device, key) for key in wanted}


    def fetch(self, keys: Sequence[ExpertKey], chosen: Sequence[ExpertKey] = ()) -> Fetch:
        """As ExpertStore.fetch; here every transfer runs before fetch returns."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        self.acquire(wanted)
        return Fetch(self, wanted)


    def next_ready(self, candidates: Sequence[ExpertKey]) -> tuple[ExpertKey, torch.Tensor]:
        """One of the fetched candidates whose bytes are in place, with its slot (all are, here)."""
        key = candidates[0]
        with self._lock:
            return key, self._slot_of(self._device, key)


    def _discard(self, keys: Iterable[ExpertKey]) -> None:
        """Forget admitted experts whose bytes did not arrive."""
        for key in keys:
            self._core.forget(key)


    def _timed_load(self, keys: list[ExpertKey]) -> None:
        """_load on the calling thread: its time is both stall and link time."""
        began = time.perf_counter()
        try:
            self._load(keys)
        finally:
            if keys:
                self._stats.transfer_s += self._waited(began, keys)


    def _load(self, keys: list[ExpertKey]) -> None:
        """Copy the bytes of keys, just admitted to the device tier, into their device slots."""
        if not keys:
            return
        dsts = [self._slot_of(self._device, key) for key in keys]
        if self._host is not None:
            for i in range(0, len(keys), self.host_slots):  # a batch never evicts its own host copies
                self._load_through_host(keys[i : i + self.host_slots], dsts[i : i + self.host_slots])
        elif self._bounce.num_slots == 0:  # the device tier is host memory: read straight into it
            self._stats.host_misses += len(keys)
            self._read_disk(keys, dsts)
        else:
            for i in range(0, len(keys), self._bounce.num_slots):
                self._load_through_bounce(keys[i : i + self._bounce.num_slots], dsts[i : i + self._bounce.num_slots])


    def _load_through_host(self, keys: list[ExpertKey], dsts: list[torch.Tensor]) -> None:
        """Host hits are copied up; the rest are read from disk into host slots (kept there), then copied up."""
        batch, slots, admitted = set(keys), [], []
        try:
            for key in keys:
                slot = self._host.cache.access(key)
                if slot is not None:
                    self._stats.host_hits += 1
                else:
                    slot = self._admit_host(key, batch)
                    admitted.append(key)
                slots.append(slot)
            self._read_disk(admitted, [self._slot_of(self._host, key) for key in admitted])
        except BaseException:
            for key in admitted:
                self._host.cache.remove(key)
            raise
        for key, dst, slot in zip(keys, dsts, slots):
            self._copy_to_device(dst, self._host.pool, slot, self._residues[key])


    def _admit_host(self, key: ExpertKey, batch: set[ExpertKey]) -> int:
        self._stats.host_misses += 1
        slot, victim = self._host.cache.admit(key, protect=batch)
        if victim is not None:
            self._stats.evictions["host"] += 1
        self._host.pool.wait_reads(slot)
        return slot


    def _load_through_bounce(self, keys: list[ExpertKey], dsts: list[torch.Tensor]) -> None:
        """No host tier but a CUDA device: read into pinned bounce slots, then copy up."""
        self._stats.host_misses += len(keys)
        for i in range(len(keys)):
            self._bounce.wait_reads(i)
        residues = [self._residues[key] for key in keys]
        self._read_disk(keys, [self._bounce.slot(i, residue) for i, residue in enumerate(residues)])
        for i, (dst, residue) in enumerate(zip(dsts, residues)):
            self._copy_to_device(dst, self._bounce, i, residue)


    def _read_disk(self, keys: list[ExpertKey], dsts: list[torch.Tensor]) -> None:
        """Reads the experts' bytes into dsts, all requests in flight together."""
        if not keys:
            return
        began = time.perf_counter()
        batch = [(self.index.locations[key].segments, dst) for key, dst in zip(keys, dsts)]
        self.reader.read_batch(batch)
        seconds, stats = time.perf_counter() - began, self._stats
        if self.timeline is not None:
            self.timeline.add("disk", lambda: "read " + expert_names(keys), began, began + seconds)
        stats.disk_read_s += seconds
        stats.disk_batches += 1
        stats.read_fit.add(len(keys), seconds)
        self._arrived(keys, dsts)


    def _copy_to_device(self, dst: torch.Tensor, pool: SlotPool, slot: int, residue: int) -> None:
        done = self._link.copy(dst, pool.slot(slot, residue))
        done.wait_on_compute()
        pool.mark_read(slot, done)
        self._stats.bytes_read["host"] += dst.numel()


    def prefetch(self, requests: Sequence[TransferRequest]) -> list[ExpertKey]:
        """Bring requested experts into the device tier, highest priority first; returns those brought.

        The transfer core admits them (`TransferCore.admit_prefetches`); the experts brought are read
        from disk together before prefetch returns.
        """
        with self._lock:
            brought = self._admit_prefetches(requests)
            try:
                self._timed_load(brought)
            except BaseException:
                self._discard(brought)
                raise
            self._stats.prefetched += len(brought)
            self._stats.prefetched_bytes += len(brought) * self.topology.expert_bytes
        return brought


    def in_flight(self) -> frozenset[ExpertKey]:
        """Experts being transferred: none, since this store moves bytes synchronously."""
        return frozenset()


    def wait_idle(self) -> None:
        """Returns at once: here transfers finish before the calls that start them return."""
