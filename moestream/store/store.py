"""The expert store: disk, a host tier and a device tier of expert slots, with budgets; what every
kind of store shares, and the calls each kind makes its own way.

Residency of each tier is an `ExpertCache` whose eviction policy is passed in; lookups, admissions
to the device tier, landings and their counts go through the transfer core
(`moestream.transfer_core`), the bookkeeping the simulator drives too. `ExpertStore` holds the
tiers (each a `Tier`: a cache and its slot pool), the disk reader and the host -> device `Link`,
and answers the views (`resident`, `pinned`, `streaming_groups`, `stats`). How bytes move is each kind's own: the
synchronous `InlineStore` (`moestream.store.inline`, `--sync`) moves them on the caller's thread,
`AsyncExpertStore` (`moestream.store.async_store`) on link workers beside compute, a chain of links
that follows its tiers; `open_store` (`moestream.store.factory`) picks one. Every kind:
`fetch` pins a layer's experts and hands them out as their bytes are in place, `release` unpins,
`plan_view` ends the previous plan and shows the tier to the next, `prefetch` admits a plan's
requests by priority (never evicting a pinned expert) and moves them. Device victims are dropped,
not written back. Public calls hold a lock. The store knows no model family and no policy.

Counters (`StoreStats`): hits/misses count the device-tier lookups of fetch and acquire (an expert
still in flight is a hit, and late); host_hits/host_misses count every device fill by where it
came from; bytes_read["disk"] is bytes read from the files, bytes_read["host"] bytes copied from
host memory to the device; stall_s the time the caller's thread waited for expert bytes,
transfer_s the time the disk link was busy, copy_s the time the asynchronous host -> device link
was busy.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from moestream.cache import CacheFullError, ExpertCache
from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.errors import CheckpointError
from moestream.link_model import ModelledLink
from moestream.policies.contracts import CacheView, EvictionPolicy, TransferRequest
from moestream.store.config import StoreConfig
from moestream.store.disk import BLOCK_BYTES, DiskReader
from moestream.store.fetch import Fetch
from moestream.store.pool import SlotPool
from moestream.store.stats import StoreStats
from moestream.store.streams import Link, make_link
from moestream.tracer import Tracer, expert_names
from moestream.topology import ExpertKey, Topology
from moestream.transfer_core import TransferCore

TIERS = ("device", "host")


@dataclass
class Tier:
    """One tier of expert slots: which experts it holds (an `ExpertCache`, by its eviction policy) and
    the slots their bytes are in (a `SlotPool`)."""

    cache: ExpertCache
    pool: SlotPool

    def slot(self, key: ExpertKey, residue: int) -> torch.Tensor:
        """The resident key's slot, starting residue bytes into its row (disk reads land in place)."""
        return self.pool.slot(self.cache.slot(key), residue)


def staging_slots(config: StoreConfig, topology: Topology, wanted: int) -> int:
    """Pinned slots that disk reads are staged through: where a CUDA device tier has no host tier."""
    pinned_device = config.uses_cuda and not config.host_slots(topology)
    return min(wanted, config.device_slots(topology)) if pinned_device else 0


class ExpertStore(ABC):
    def __init__(self, index: ExpertIndex, config: StoreConfig,
                 device_eviction: EvictionPolicy, host_eviction: EvictionPolicy, integrity: Integrity | None = None,
                 reader: DiskReader | None = None, link: Link | None = None, staging: int = 0,
                 tracer: Tracer | None = None):
        """integrity: checks each expert's bytes just read from disk (e.g. a checkpoint Manifest); reader
        and link replace the disk reader and the host -> device copy link (default: made for config);
        staging: pinned slots disk reads pass through on their way up (see `staging_slots`)."""
        self.index = index
        self.integrity = integrity
        self.config = config
        self.topology: Topology = index.topology
        _check_index(index)
        self.device_slots = config.device_slots(self.topology)
        self.host_slots = config.host_slots(self.topology)
        expert_bytes, pin = self.topology.expert_bytes, config.uses_cuda
        self._device = Tier(ExpertCache(self.device_slots, device_eviction),
                            SlotPool(self.device_slots, expert_bytes, config.device))
        self._host = Tier(ExpertCache(self.host_slots, host_eviction),
                          SlotPool(self.host_slots, expert_bytes, "cpu", pin_memory=pin)) if self.host_slots else None
        self._bounce = SlotPool(staging, expert_bytes, "cpu", pin_memory=pin)
        self.reader = reader or DiskReader(direct_io=config.direct_io)  # public: callers may wrap it
        self._residues = {key: index.residue(key, BLOCK_BYTES) for key in index.locations}  # slot placement
        self._link = link or make_link(config.device)  # host -> device
        self._lock = threading.RLock()
        self._core: TransferCore = TransferCore(self._device.cache, self._displaced)  # residency and its counts
        self._stats = StoreStats()
        self.timeline: Tracer | None = tracer  # records waits and transfers when given

    # -- the calls each kind makes its own way ---------------------------------------------------

    @abstractmethod
    def fetch(self, keys: Sequence[ExpertKey], chosen: Sequence[ExpertKey] = ()) -> Fetch:
        """Pins keys in the device tier and brings in the missing ones; the Fetch hands them out.
        chosen: every expert the gate chose in these layers (keys may be one group of them)."""

    @abstractmethod
    def acquire(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """Pins keys in the device tier; returns their 1-D uint8 slots once their bytes are in place."""

    @abstractmethod
    def next_ready(self, candidates: Sequence[ExpertKey]) -> tuple[ExpertKey, torch.Tensor]:
        """One of the fetched candidates whose bytes are in place, with its slot."""

    @abstractmethod
    def prefetch(self, requests: Sequence[TransferRequest]) -> list[ExpertKey]:
        """Brings requested experts into the device tier, highest priority first; returns those admitted."""


    @abstractmethod
    def in_flight(self) -> frozenset[ExpertKey]:
        """Experts admitted whose bytes are on their way."""

    @abstractmethod
    def wait_idle(self) -> None:
        """Blocks until no transfer is in flight."""

    # -- demand path ---------------------------------------------------------------------------

    def release(self, keys: Iterable[ExpertKey]) -> None:
        """Unpin experts returned by acquire (once per acquire)."""
        with self._lock:
            self._device.cache.unpin(_key(k) for k in keys)

    def _check_fits(self, wanted: list[ExpertKey]) -> None:
        others = self._pinned() - set(wanted)
        if len(wanted) + len(others) > self.device_slots:
            raise CacheFullError(
                f"{len(wanted)} experts requested while {len(others)} others are in use, but the device "
                f"tier holds {self.device_slots}; use streaming_groups() or raise the device budget"
            )

    def _pinned(self) -> set[ExpertKey]:
        """Experts pinned by callers (a plan's pins do not count: a demand releases them)."""
        return set(self._device.cache.pinned()).difference(self._core.plan)

    def _displaced(self, transfer) -> None:
        """An expert left the device tier while its transfer moved (a kind that moves bytes between
        calls makes its slot safe to reuse)."""

    # -- filling device slots ------------------------------------------------------------------

    def _waited(self, began: float, keys: Sequence[ExpertKey]) -> float:
        """The compute thread waited for these experts' bytes from began until now; returns the seconds."""
        ended = time.perf_counter()
        self._stats.stall_s += ended - began
        if self.timeline is not None:
            self.timeline.add("wait", lambda: expert_names(keys), began, ended)
        return ended - began

    def _arrived(self, keys: Sequence[ExpertKey], slots: Sequence[torch.Tensor]) -> None:
        """The one place that runs after experts' bytes are read from disk into their slots (both modes).

        A damaged expert raises IntegrityError here, before any slot holding it is used."""
        self._stats.bytes_read["disk"] += len(keys) * self.topology.expert_bytes
        if self.integrity is not None:
            self.integrity.check_batch(keys, slots)

    def _slot_of(self, tier: Tier, key: ExpertKey) -> torch.Tensor:
        """key's slot in tier, placed so that its disk reads land in place."""
        return tier.slot(key, self._residues[key])

    # -- plans -------------------------------------------------------------------------------

    def plan_view(self, layer_now: int) -> CacheView:
        """Ends the previous plan (its experts keep their slots) and shows the tier to the next planner."""
        with self._lock:
            return self._core.plan_view(layer_now, self.topology.num_layers)

    def end_plan(self) -> None:
        """An empty plan: the previous plan's pins are released (its transfers go on)."""
        with self._lock:
            self._core.end_plan()

    def _admit_prefetches(self, requests: Sequence[TransferRequest]) -> list[ExpertKey]:
        """The core's prefetch admission, best first: the experts admitted (pinned until the next plan)."""
        return self._core.admit_prefetches([_key(r.key) for r in sorted(requests, key=lambda r: -r.priority)])

    # -- views of the state --------------------------------------------------------------------

    def model_link(self, link: ModelledLink | None) -> None:
        """The transfer core keeps this model of the disk link for the planner's view (`link_state`)."""
        with self._lock:
            self._core.link = link

    def resident(self, tier: str = "device") -> frozenset[ExpertKey]:
        with self._lock:
            cache = self._cache(tier)
            return cache.resident() if cache is not None else frozenset()

    def pinned(self, tier: str = "device") -> frozenset[ExpertKey]:
        """Experts holding a pin in the tier (a caller's, or a transfer's while it moves), resident or not."""
        with self._lock:
            cache = self._cache(tier)
            return cache.pin_holders() if cache is not None else frozenset()

    def streaming_groups(self, keys: Sequence[ExpertKey]) -> list[list[ExpertKey]]:
        """Split a layer's experts into groups that fit the device tier at once, resident ones first."""
        wanted = list(dict.fromkeys(_key(k) for k in keys))
        with self._lock:
            room = self.device_slots - len(self._pinned() - set(wanted))
            if wanted and room < 1:
                raise CacheFullError(f"all {self.device_slots} device slots hold experts in use")
            cache = self._device.cache
            ordered = [k for k in wanted if k in cache] + [k for k in wanted if k not in cache]
        return [ordered[i : i + room] for i in range(0, len(ordered), room)]

    def stats(self) -> StoreStats:
        with self._lock:
            stats, counts = self._stats.copy(), self._core.counts
            stats.hits, stats.misses, stats.late = counts.hits, counts.misses, counts.late
            stats.prefetch_hits, stats.prefetch_wasted = counts.prefetch_hits, counts.wasted
            stats.evictions["device"] = counts.evictions
            return stats

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = StoreStats()
            self._core.reset_counts()

    def close(self) -> None:
        with self._lock:
            self._link.synchronize()
            self.reader.close()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cache(self, tier: str) -> ExpertCache | None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        found = self._device if tier == "device" else self._host
        return found.cache if found is not None else None


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
