"""The expert store: disk, a host tier and a device tier of expert slots, and the calls that bring
experts in; one class for every mode, composed with an executor that decides where bytes move.

Each tier is a `Tier`: an `ExpertCache` whose eviction policy is passed in, and its slot pool.
Residency is the transfer core's (`moestream.transfer_core`); transfers are queued, landed, failed
and displaced in the `LinkChain` (`moestream.store.chain`). The `Executor` runs the links' rounds:
inline on the caller's thread (`--sync`: every call returns with its bytes in place), or on a worker
per link, where every wait has a timeout (`StoreConfig.transfer_timeout_s`). Public calls hold a lock.

Calls: `fetch` pins a layer's experts and makes its misses and in-flight experts demand (the `Fetch`
hands them out as their bytes land); `prefetch` admits a plan's requests by priority (never evicting
a pinned expert) and queues them; `plan_view` ends the previous plan. Device victims are dropped.

Stream order (`moestream.store.streams`): an expert lands when its last copy is issued; `next_ready`
makes the caller's current stream wait for that copy (the host does not wait), and `release` records
that stream as the slots' last reader, which a copy into one of them waits for.

Counters (`StoreStats`): hits/misses count device-tier lookups (an expert still in flight is a hit,
and late); host_hits/host_misses count device fills by source. Times come from the tracer's lanes
since `reset_stats`: stall_s (the executor's), transfer_s and disk_read_s (the "disk" lane),
disk_batches (its rounds), copy_s ("h2d": on CUDA the time to issue the copies). The store knows no
model family, no policy and no device type (the `Link` decides how bytes move up).
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Callable, Iterable, Sequence

import torch

from moestream.cache import CacheFullError
from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.contracts import CacheView, EvictionPolicy, TransferRequest
from moestream.link_model import ModelledLink
from moestream.store.chain import LinkChain, Tier
from moestream.store.config import StoreConfig
from moestream.store.copies import copy_round, read_round
from moestream.store.disk import BLOCK_BYTES, DiskReader
from moestream.store.executor import Executor, executor_for
from moestream.store.fetch import Fetch
from moestream.store.pool import SlotPool
from moestream.store.stats import StoreStats
from moestream.store.streams import Link, make_link
from moestream.store.tiers import TIERS, as_key, check_index, make_tiers, staging_slots
from moestream.store.transfer import DISK, H2D, TransferError, pieces
from moestream.topology import ExpertKey, Topology
from moestream.tracer import Tracer, expert_names, since

__all__ = ["TIERS", "ExpertStore", "StoreStats"]


class ExpertStore:
    def __init__(self, index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
                 host_eviction: EvictionPolicy, integrity: Integrity | None = None, reader: DiskReader | None = None,
                 link: Link | None = None, staging: int | None = None, executor: Executor | None = None,
                 tracer: Tracer | None = None):
        """integrity: checks each expert's bytes just read (e.g. a Manifest); reader, link: the disk reader
        and host -> device link; staging: pinned slots reads pass through on their way up; executor: where
        the rounds run; tracer: told of waits and rounds. Defaults are made for config."""
        self.index, self.integrity, self.config = index, integrity, config
        self.topology: Topology = index.topology
        check_index(index)
        self.device_slots, self.host_slots = config.device_slots(self.topology), config.host_slots(self.topology)
        self._device, self._host = make_tiers(config, self.topology, device_eviction, host_eviction)
        staging = staging_slots(config, self.topology) if staging is None else staging
        self._bounce = SlotPool(staging, self.topology.expert_bytes, "cpu", pin_memory=config.uses_cuda)
        self.reader = reader or DiskReader(direct_io=config.direct_io)  # public: callers may wrap it
        self._link = link or make_link(config.device)  # host -> device
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._chain = LinkChain(lambda key: pieces(index.locations[key].segments, config.chunk_bytes),
                                _residues(index, self.device_slots), (self._device, self._host), integrity,
                                self._cond, self._wait, self.topology.expert_bytes)
        self._core = self._chain.core
        self.tracer = tracer or Tracer()
        self._since = self.tracer.totals()
        self._closed = False
        read = lambda batch: self.reader.read_batch(batch)  # self.reader: callers may wrap it since
        links = self._chain.make_links(partial(read_round, read, self._bounce, self._link),
                                       partial(copy_round, self._link))
        self.executor = executor or executor_for(config)
        self.executor.start(self._cond, links, self.tracer)

    def fetch(self, keys: Sequence[ExpertKey], chosen: Sequence[ExpertKey] = ()) -> Fetch:
        """Pins keys and brings in the missing ones; chosen: the gate's choice in these layers (default: keys)."""
        wanted = list(dict.fromkeys(as_key(k) for k in keys))
        with self._lock:
            self._check_open()
            self._check_fits(wanted)
            late, missed = self._chain.fetch(wanted, {as_key(k) for k in chosen})  # pinned until release
            self._chain.bring(wanted, missed)
            try:
                self.executor.queued(lambda: expert_names(wanted))
            except BaseException:
                self._device.cache.unpin(wanted)
                raise
            landed = None if late or missed or any(key in self._chain.errors for key in wanted) else [
                (key, self._chain.slot(self._device, key), self._chain.arrival(key)) for key in wanted]
        return Fetch(self, wanted, landed)  # landed: every slot handed over now (the lean path)

    def acquire(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """Pins keys in the device tier; returns their 1-D uint8 slots once their bytes are in place."""
        fetch = self.fetch(keys)
        try:
            return dict(fetch.ready())
        except BaseException:
            fetch.release()
            raise

    def next_ready(self, candidates: Sequence[ExpertKey]) -> tuple[ExpertKey, torch.Tensor]:
        """The first fetched candidate in place (waiting for one), and its slot; the stream waits for its copy."""
        with self._lock:
            if self._first_ready(candidates) is None:
                with self.tracer.span("wait", lambda: expert_names(candidates)):
                    self._wait(lambda: self._first_ready(candidates) is not None,
                               f"experts {[tuple(k) for k in candidates]}")
            key = self._first_ready(candidates)
            slot, arrival = self._chain.slot(self._device, key), self._chain.arrival(key)
        if arrival is not None:
            arrival.wait_on_compute()
        return key, slot

    def release(self, keys: Iterable[ExpertKey]) -> None:
        """Unpin experts returned by acquire (once), on the stream whose kernels read their slots, after those."""
        read = self._link.compute_event()
        with self._lock:
            keys = [as_key(k) for k in keys]
            self._chain.read_by(keys, read)
            self._device.cache.unpin(keys)

    def hold_host(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """Pins those of keys whose bytes are whole in the host tier; their host slots (`release_host` unpins)."""
        with self._lock:
            self._check_open()
            held = self._chain.hold_host([as_key(key) for key in keys])
            return {key: self._chain.slot(self._host, key) for key in held}

    def read_direct(self, key: ExpertKey, dst: torch.Tensor) -> None:
        """Reads key's bytes into dst (1-D uint8 host memory), checked, beside the tiers (host compute)."""
        key = as_key(key)
        self.reader.read(self.index.locations[key].segments, dst)
        if self.integrity is not None:
            check = self.integrity.begin(key)
            check.update(dst)
            if not check.done:
                raise TransferError(f"reading expert {tuple(key)} from disk gave fewer bytes than it has")
        with self._lock:
            self._chain.stats.bytes_read["disk"] += self.index.topology.expert_bytes

    def release_host(self, keys: Iterable[ExpertKey]) -> None:
        with self._lock:
            if self._host is not None:
                self._host.cache.unpin([as_key(key) for key in keys])
                self._cond.notify_all()

    def prefetch(self, requests: Sequence[TransferRequest]) -> list[ExpertKey]:
        """Admits and queues the requested experts by priority; returns those admitted (raising any failure)."""
        with self._lock:
            self._check_open()
            brought = self._chain.prefetch({as_key(r.key): r.priority for r in requests})
            self.executor.queued(lambda: "prefetch " + expert_names(brought))
            for key in brought:
                if key in self._chain.errors:
                    raise self._chain.errors.pop(key)
        return brought

    def wait_idle(self) -> None:
        """Blocks until no transfer is in flight (e.g. after a preload); raises the first failure."""
        with self._lock:
            self._wait(lambda: not self._core.moving, f"{len(self._core.moving)} transfers in flight")
            if self._chain.errors:
                error = next(iter(self._chain.errors.values()))
                self._chain.errors.clear()
                raise error

    def close(self) -> None:
        """Stops the executor after its rounds, drops the queued transfers, closes the files, frees the slots."""
        with self._lock:
            self._closed = True
        self.executor.stop()
        with self._cond:
            for transfer in list(self._core.moving.values()):
                self._chain.forget(transfer)
            for link in self._chain.links.values():
                link.queue.drain()
            self._cond.notify_all()
            self._link.synchronize()
            self.reader.close()
            for pool in self.slot_pools().values():
                pool.release()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plan_view(self, layer_now: int) -> CacheView:
        """Ends the previous plan (its experts keep their slots) and shows the tier to the next planner."""
        with self._lock:
            return self._core.plan_view(layer_now, self.topology.num_layers)

    def end_plan(self) -> None:
        """An empty plan: the previous plan's pins are released (its transfers go on)."""
        with self._lock:
            self._core.end_plan()

    def model_link(self, link: ModelledLink | None) -> None:
        """The transfer core keeps this model of the disk link for the planner's view (`link_state`)."""
        with self._lock:
            self._core.link = link

    def resident(self, tier: str = "device") -> frozenset[ExpertKey]:
        """Experts whose bytes are in place in the tier (those still arriving there excluded)."""
        with self._lock:
            found = self._tier(tier)
            arriving = {key for key, t in self._core.moving.items() if tier == "device" or t.link == DISK}
            return found.cache.resident() - arriving if found is not None else frozenset()

    def resident_layer(self, layer: int) -> list[torch.Tensor] | None:
        """A layer's device slots in expert order, where the tier holds the whole model and they have landed;
        else None. The current stream waits for their copies."""
        topology = self.topology
        with self._lock:
            self._check_open()
            keys = [ExpertKey(layer, expert) for expert in range(topology.num_experts)]
            cache = self._device.cache
            if (self.device_slots < topology.total_experts
                    or any(key not in cache or key in self._core.moving or key in self._chain.errors for key in keys)):
                return None
            slots = [self._chain.slot(self._device, key) for key in keys]
            arrivals = [self._chain.arrival(key) for key in keys]
        for arrival in arrivals:
            if arrival is not None:
                arrival.wait_on_compute()
        return slots

    def count_hits(self, num_hits: int) -> None:
        """Lookups the caller made of experts `resident_layer` handed out (hits, none late)."""
        with self._lock:
            self._core.counts.hits += num_hits

    def pinned(self, tier: str = "device") -> frozenset[ExpertKey]:
        """Experts holding a pin in the tier (a caller's, or a transfer's while it moves), resident or not."""
        with self._lock:
            found = self._tier(tier)
            return found.cache.pin_holders() if found is not None else frozenset()

    def in_flight(self) -> frozenset[ExpertKey]:
        """Experts admitted whose bytes are queued or moving (none between calls of an inline executor)."""
        with self._lock:
            return frozenset(self._core.moving)

    def slot_pools(self) -> dict[str, SlotPool]:
        """The memory the store holds: each tier's slot pool, and the staging slots (maybe none)."""
        pools = {"device": self._device.pool, "staging": self._bounce}
        return pools | ({"host": self._host.pool} if self._host is not None else {})

    def streaming_groups(self, keys: Sequence[ExpertKey]) -> list[list[ExpertKey]]:
        """Split a layer's experts into groups that fit the device tier at once, resident ones first."""
        wanted = list(dict.fromkeys(as_key(k) for k in keys))
        with self._lock:
            room = self.device_slots - len(self._pinned() - set(wanted))
            if wanted and room < 1:
                raise CacheFullError(f"all {self.device_slots} device slots hold experts in use")
            cache = self._device.cache
            ordered = [k for k in wanted if k in cache] + [k for k in wanted if k not in cache]
        return [ordered[i : i + room] for i in range(0, len(ordered), room)]

    def stats(self) -> StoreStats:
        with self._lock:
            stats, counts = self._chain.stats.copy(), self._core.counts
            stats.hits, stats.misses, stats.late = counts.hits, counts.misses, counts.late
            stats.prefetch_hits, stats.prefetch_wasted = counts.prefetch_hits, counts.wasted
            stats.evictions["device"] = counts.evictions
            window = partial(since, self.tracer.totals(), self._since)
            stats.stall_s = self.executor.stall_s(window)
            stats.transfer_s = stats.disk_read_s = window(DISK).seconds
            stats.disk_batches, stats.copy_s = window(DISK).spans, window(H2D).seconds
            return stats

    def reset_stats(self) -> None:
        with self._lock:
            self._chain.stats, self._since = StoreStats(), self.tracer.totals()
            self._core.reset_counts()

    def _first_ready(self, candidates: Sequence[ExpertKey]) -> ExpertKey | None:
        """The first candidate in place; raises the failure of any before it."""
        self._check_open()
        for key in candidates:
            if key in self._chain.errors:
                raise self._chain.errors.pop(key)
            if key not in self._core.moving:
                return key
        return None

    def _wait(self, ready: Callable[[], bool], what: str, patient: bool = True) -> bool:
        return self.executor.wait(lambda: self._check_open() or ready(), what, patient)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the expert store is closed")

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

    def _tier(self, tier: str) -> Tier | None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        return self._device if tier == "device" else self._host


def _residues(index: ExpertIndex, device_slots: int) -> dict[ExpertKey, int]:
    """Where each expert's bytes start in its slot: congruent to its file offsets (O_DIRECT reads land in
    place), but at the aligned start where the device tier holds every expert, so that a layer's slots form
    one evenly spaced [E, ...] view (the reads' unaligned ends then pass through staging)."""
    if device_slots >= len(index.locations):
        return dict.fromkeys(index.locations, 0)
    return {key: index.residue(key, BLOCK_BYTES) for key in index.locations}
