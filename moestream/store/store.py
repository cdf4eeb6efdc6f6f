"""The expert store: disk, a host tier and a device tier of expert slots, with budgets and copies.

Residency of each tier is an `ExpertCache` whose eviction policy is passed in; the store knows no
policy by name. `acquire` makes experts resident in the device tier and pins them until `release`;
a device miss is served from the host tier when it holds the expert (one host->device copy), else
from disk into a host slot and on to the device (the host tier keeps the copy), or from disk
straight into the device slot when the host tier has no slots. Device victims are dropped, not
written back. `prefetch` brings requested experts in by priority without ever evicting a pinned
expert. Each call admits all its misses first and then reads them from disk as one batch, so that
the disk reader keeps their requests in flight together. Calls return once the bytes are in
place; public calls hold a lock so that a prefetch worker can run beside the compute thread. The
store knows no model family and no policy.

Counters: hits/misses count acquire's device-tier lookups; host_hits/host_misses count every
device fill (demand or prefetch) by where it came from; bytes_read["disk"] is bytes read from the
files, bytes_read["host"] bytes copied from host memory to the device.

Asynchronous mode (`StoreConfig.asynchronous`; the subclasses in `moestream.store.async_store`,
one tier, and `moestream.store.tiered`, a host tier with a worker per link; `open_store` in
`moestream.store.factory` picks one): `prefetch` admits its experts and queues their transfers for
the I/O workers (`moestream.store.transfer`, `moestream.store.copier`) and returns at once; `fetch`
pins a layer's experts, puts its misses at the head of the queue, drops the queued speculative
transfers of the same layers that the gate did not choose, and hands the experts out as they land.
An admitted expert whose bytes are in flight is pinned by its transfer, so that nothing evicts a
slot being written. Every wait has a timeout. stall_s counts the time the caller's thread waited
for expert bytes, transfer_s the time the disk link was busy (both equal in synchronous mode, where
every transfer runs on the caller), copy_s the time the asynchronous host -> device link was busy.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable, Sequence

import torch

from moestream.cache import CacheFullError, ExpertCache
from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.errors import CheckpointError
from moestream.policies.contracts import EvictionPolicy, TransferRequest
from moestream.store.config import StoreConfig
from moestream.store.disk import BLOCK_BYTES, DiskReader
from moestream.store.fetch import Fetch
from moestream.store.pool import SlotPool
from moestream.store.stats import StoreStats
from moestream.store.streams import Link, make_link
from moestream.timeline import Timeline, expert_names
from moestream.topology import ExpertKey, Topology
from moestream.transfer_core import HIT, TransferCore

TIERS = ("device", "host")
BOUNCE_SLOTS = 8  # pinned staging slots between disk and a CUDA device tier when there is no host tier


class ExpertStore:
    bounce_slots = BOUNCE_SLOTS  # pinned staging slots when a CUDA device tier has no host tier

    def __init__(self, index: ExpertIndex, config: StoreConfig,
                 device_eviction: EvictionPolicy, host_eviction: EvictionPolicy, integrity: Integrity | None = None,
                 reader: DiskReader | None = None, link: Link | None = None):
        """integrity: checks each expert's bytes just read from disk (e.g. a checkpoint Manifest); reader
        and link replace the disk reader and the host -> device copy link (default: made for config)."""
        self.index = index
        self.integrity = integrity
        self.config = config
        self.topology: Topology = index.topology
        _check_index(index)
        self.device_slots = config.device_slots(self.topology)
        self.host_slots = config.host_slots(self.topology)
        self._device = ExpertCache(self.device_slots, device_eviction)
        self._host = ExpertCache(self.host_slots, host_eviction) if self.host_slots else None
        expert_bytes, pin = self.topology.expert_bytes, config.uses_cuda
        self._device_pool = SlotPool(self.device_slots, expert_bytes, config.device)
        self._host_pool = SlotPool(self.host_slots, expert_bytes, "cpu", pin_memory=pin)
        self._bounce = SlotPool(self._staging_slots(pin), expert_bytes, "cpu", pin_memory=pin)
        self._reader = reader or DiskReader(direct_io=config.direct_io)
        self._residues = {key: index.residue(key, BLOCK_BYTES) for key in index.locations}  # slot placement
        self._link = link or make_link(config.device)  # host -> device
        self._lock = threading.RLock()
        self._core: TransferCore = TransferCore(self._device)  # lookups, admissions, landings, counts
        self._stats = StoreStats()
        self.timeline: Timeline | None = None  # records waits and transfers when set (record_timeline)

    def record_timeline(self, timeline: Timeline | None) -> None:
        self.timeline = timeline

    def _staging_slots(self, pinned: bool) -> int:
        """Bounce slots: where the device tier is not host memory and no host tier is there instead."""
        return min(self.bounce_slots, self.device_slots) if pinned and not self.host_slots else 0

    # -- demand path ---------------------------------------------------------------------------

    def acquire(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """Make keys resident in the device tier and pin them; returns their 1-D uint8 slots.

        The misses are admitted first, then their bytes are brought in together (one batch of disk reads)."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        with self._lock:
            self._check_fits(wanted)
            pinned, misses = [], []  # experts pinned so far, and the misses among them
            try:
                for key in wanted:
                    if self._core.lookup(key) != HIT:
                        self._stats.misses += 1
                        self._admit(key)
                        misses.append(key)
                    self._device.pin([key])
                    pinned.append(key)
                self._timed_load(misses)
            except BaseException:
                self._device.unpin(pinned)
                self._discard(misses)
                raise
            return {key: self._slot_of(self._device_pool, self._device, key) for key in wanted}

    def release(self, keys: Iterable[ExpertKey]) -> None:
        """Unpin experts returned by acquire (once per acquire)."""
        with self._lock:
            self._device.unpin(_key(k) for k in keys)

    def fetch(self, keys: Sequence[ExpertKey], chosen: Sequence[ExpertKey] = ()) -> "Fetch":
        """Pins keys in the device tier and brings in the missing ones; the Fetch hands them out.
        chosen: every expert the gate chose in these layers (keys may be one group of them).

        Here every transfer runs before fetch returns (the synchronous, on-demand path)."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        self.acquire(wanted)
        return Fetch(self, wanted)

    def next_ready(self, candidates: Sequence[ExpertKey]) -> tuple[ExpertKey, torch.Tensor]:
        """One of the fetched candidates whose bytes are in place, with its slot (all are, here)."""
        key = candidates[0]
        with self._lock:
            return key, self._slot_of(self._device_pool, self._device, key)

    def _late(self, key: ExpertKey) -> None:
        """key was asked for while its bytes were in flight: a miss, never a prefetch hit."""
        self._device.access(key)
        self._stats.misses += 1
        self._stats.late += 1
        self._core.used(key)

    def _check_fits(self, wanted: list[ExpertKey]) -> None:
        others = self._pinned() - set(wanted)
        if len(wanted) + len(others) > self.device_slots:
            raise CacheFullError(
                f"{len(wanted)} experts requested while {len(others)} others are in use, but the device "
                f"tier holds {self.device_slots}; use streaming_groups() or raise the device budget"
            )

    def _pinned(self) -> set[ExpertKey]:
        return set(self._device.pinned())

    # -- filling device slots ------------------------------------------------------------------

    def _admit(self, key: ExpertKey) -> None:
        """A device slot for key (evicting by policy); its bytes come with _load."""
        self._core.admit(key)

    def _discard(self, keys: Iterable[ExpertKey]) -> None:
        """Forget admitted experts whose bytes did not arrive."""
        for key in keys:
            if key in self._device:
                self._device.remove(key)

    def _timed_load(self, keys: list[ExpertKey]) -> None:
        """_load on the calling thread: its time is both stall and link time."""
        began = time.perf_counter()
        try:
            self._load(keys)
        finally:
            if keys:
                self._stats.transfer_s += self._waited(began, keys)

    def _waited(self, began: float, keys: Sequence[ExpertKey]) -> float:
        """The compute thread waited for these experts' bytes from began until now; returns the seconds."""
        ended = time.perf_counter()
        self._stats.stall_s += ended - began
        if self.timeline is not None:
            self.timeline.add("wait", expert_names(keys), began, ended)
        return ended - began

    def _load(self, keys: list[ExpertKey]) -> None:
        """Copy the bytes of keys, just admitted to the device tier, into their device slots."""
        if not keys:
            return
        dsts = [self._slot_of(self._device_pool, self._device, key) for key in keys]
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
                slot = self._host.access(key)
                if slot is not None:
                    self._stats.host_hits += 1
                else:
                    slot = self._admit_host(key, batch)
                    admitted.append(key)
                slots.append(slot)
            self._read_disk(admitted, [self._slot_of(self._host_pool, self._host, key) for key in admitted])
        except BaseException:
            for key in admitted:
                self._host.remove(key)
            raise
        for key, dst, slot in zip(keys, dsts, slots):
            self._copy_to_device(dst, self._host_pool, slot, self._residues[key])

    def _admit_host(self, key: ExpertKey, batch: set[ExpertKey]) -> int:
        self._stats.host_misses += 1
        slot, victim = self._host.admit(key, protect=batch)
        if victim is not None:
            self._stats.evictions["host"] += 1
        self._host_pool.wait_reads(slot)
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
        self._reader.read_batch(batch)
        seconds, stats = time.perf_counter() - began, self._stats
        if self.timeline is not None:
            self.timeline.add("disk", "read " + expert_names(keys), began, began + seconds)
        stats.disk_read_s += seconds
        stats.disk_batches += 1
        stats.read_fit.add(len(keys), seconds)
        self._arrived(keys, dsts)

    def _arrived(self, keys: Sequence[ExpertKey], slots: Sequence[torch.Tensor]) -> None:
        """The one place that runs after experts' bytes are read from disk into their slots (both modes).

        A damaged expert raises IntegrityError here, before any slot holding it is used."""
        self._stats.bytes_read["disk"] += len(keys) * self.topology.expert_bytes
        if self.integrity is not None:
            self.integrity.check_batch(keys, slots)

    def _slot_of(self, pool: SlotPool, tier: ExpertCache, key: ExpertKey) -> torch.Tensor:
        """key's slot in tier, placed so that its disk reads land in place."""
        return pool.slot(tier.slot(key), self._residues[key])

    def _copy_to_device(self, dst: torch.Tensor, pool: SlotPool, slot: int, residue: int) -> None:
        done = self._link.copy(dst, pool.slot(slot, residue))
        done.wait_on_compute()
        pool.mark_read(slot, done)
        self._stats.bytes_read["host"] += dst.numel()

    # -- prefetch ------------------------------------------------------------------------------

    def prefetch(self, requests: Sequence[TransferRequest]) -> list[ExpertKey]:
        """Bring requested experts into the device tier, highest priority first; returns those brought.

        Requested experts already resident are kept: no later, lower-priority request of the same
        call evicts them, nor those it brought. Stops when every slot holds a pinned or kept expert.
        The experts brought are read from disk together.
        """
        with self._lock:
            brought, kept = self._admit_prefetches(requests)
            try:
                self._timed_load(brought)
            except BaseException:
                self._discard(brought)
                raise
            finally:
                self._device.unpin(brought + kept)
            for key in brought:
                self._core.landed(key, prefetch=True)
            self._stats.prefetched += len(brought)
            self._stats.prefetched_bytes += len(brought) * self.topology.expert_bytes
        return brought

    def _admit_prefetches(self, requests: Sequence[TransferRequest]) -> tuple[list[ExpertKey], list[ExpertKey]]:
        """Admits (and pins) the experts to bring; pins the requested ones already resident."""
        brought, kept = [], []  # experts admitted to bring in, and those resident already
        for request in sorted(requests, key=lambda r: -r.priority):
            key = _key(request.key)
            if key in self._device:
                self._device.pin([key])
                kept.append(key)
                continue
            if len(self._device) >= self.device_slots and not self._device.has_evictable():
                break
            self._admit(key)
            self._device.pin([key])
            brought.append(key)
        return brought, kept

    def drop_plan(self) -> None:
        """Drops the previous plan's prefetches that have not started (none here: prefetch runs them)."""

    # -- views of the state --------------------------------------------------------------------

    def resident(self, tier: str = "device") -> frozenset[ExpertKey]:
        with self._lock:
            cache = self._cache(tier)
            return cache.resident() if cache is not None else frozenset()

    def pinned(self, tier: str = "device") -> frozenset[ExpertKey]:
        """Experts holding a pin in the tier (a caller's, or a transfer's while it moves), resident or not."""
        with self._lock:
            cache = self._cache(tier)
            return cache.pin_holders() if cache is not None else frozenset()

    def in_flight(self) -> frozenset[ExpertKey]:
        """Experts being transferred: none, since this store moves bytes synchronously."""
        return frozenset()

    def streaming_groups(self, keys: Sequence[ExpertKey]) -> list[list[ExpertKey]]:
        """Split a layer's experts into groups that fit the device tier at once, resident ones first."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        with self._lock:
            room = self.device_slots - len(self._pinned() - set(wanted))
            if wanted and room < 1:
                raise CacheFullError(f"all {self.device_slots} device slots hold experts in use")
            ordered = [k for k in wanted if k in self._device] + [k for k in wanted if k not in self._device]
        return [ordered[i : i + room] for i in range(0, len(ordered), room)]

    def wait_idle(self) -> None:
        """Returns at once: here transfers finish before the calls that start them return."""

    def stats(self) -> StoreStats:
        with self._lock:
            stats, counts = self._stats.copy(), self._core.counts
            stats.hits, stats.prefetch_hits, stats.prefetch_wasted = counts.hits, counts.prefetch_hits, counts.wasted
            stats.evictions["device"] = counts.evictions
            return stats

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = StoreStats()
            self._core.reset_counts()

    def close(self) -> None:
        with self._lock:
            self._link.synchronize()
            self._reader.close()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cache(self, tier: str) -> ExpertCache | None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        return self._device if tier == "device" else self._host


def _key(key: Sequence[int]) -> ExpertKey:
    if type(key) is ExpertKey and type(key.layer) is int and type(key.expert) is int:
        return key
    return ExpertKey(int(key[0]), int(key[1]))


def _check_index(index: ExpertIndex) -> None:
    """Every expert of the topology has a location of exactly expert_bytes."""
    topology = index.topology
    for key in topology.keys():
        location = index.locations.get(key)
        if location is None:
            raise CheckpointError(f"the expert index has no location for layer {key.layer} expert {key.expert}")
        if location.nbytes != topology.expert_bytes:
            raise CheckpointError(
                f"expert {tuple(key)} has {location.nbytes} bytes on disk, the topology says {topology.expert_bytes}"
            )
