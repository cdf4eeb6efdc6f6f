"""The expert store: disk, a host tier and a device tier of expert slots, and the one place their
transfers are queued, landed and failed.

Residency of each tier is an `ExpertCache` whose eviction policy is passed in (each tier a `Tier`: a
cache and its slot pool, `moestream.store.tiers`); lookups, admissions to the device tier, landings
and their counts go through the transfer core (`moestream.transfer_core`), the bookkeeping the
simulator drives too: an expert is in the device tier from its admission, whether its bytes have
landed or not; this store only moves them. Bytes move on a chain of links that follows the tiers
(`moestream.store.transfer`): disk -> device, or disk -> host -> device where a host tier is kept
apart. A host hit goes straight to the host -> device queue; a miss takes a host slot, is read into
it, checked there (integrity), then re-queued on the copy link with its demand and priority; the
host tier keeps the copy and evicts by its own policy, and a host slot stays pinned while the disk
writes it and while the copy reads it. Where the links' rounds run is the executor's
(`moestream.store.executor`): inline on the caller's thread (`--sync`), or on workers.

Calls: `fetch` pins a layer's experts, makes its misses demand at the head of the queue, its
in-flight experts demand wherever they are queued, and sends the queued speculation of its layers
that the gate did not choose to the back; the `Fetch` hands the experts out as their bytes land.
`prefetch` admits a plan's requests by priority (never evicting a pinned expert) and queues them;
`plan_view` ends the previous plan. A transfer whose expert the core evicts (`_displaced`) is
cancelled if queued, else moved no further; a failed one takes its expert out of the tier, its
error kept for the thread that waits on it. A demand miss that finds every host slot pinned waits
for a copy; a speculative one is refused unless the executor can run the copy itself. Device
victims are dropped, not written back. Public calls hold a lock.

Counters (`StoreStats`): hits/misses count the device-tier lookups of fetch and acquire (an expert
still in flight is a hit, and late); host_hits/host_misses count every device fill by where it came
from; bytes_read["disk"] is bytes read from the files, bytes_read["host"] bytes copied up from the
host tier. Times come from the tracer's lanes since `reset_stats`: stall_s (the executor's stall),
transfer_s and disk_read_s ("disk": the disk link busy), disk_batches (its rounds), copy_s ("h2d").
The store knows no model family, no policy and no device type (the `Link` decides how bytes move up).
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Callable, Iterable, Sequence

import torch

from moestream.cache import CacheFullError
from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.errors import CheckpointError
from moestream.link_model import ModelledLink
from moestream.policies.contracts import CacheView, EvictionPolicy, TransferRequest
from moestream.store.config import StoreConfig
from moestream.store.disk import BLOCK_BYTES, DiskReader
from moestream.store.executor import Executor, executor_for
from moestream.store.fetch import Fetch
from moestream.store.pool import SlotPool
from moestream.store.stats import StoreStats
from moestream.store.streams import Link, make_link
from moestream.store.tiers import TIERS, Tier, as_key, check_index, make_tiers, staging_slots
from moestream.store.transfer import (DISK, H2D, LinkReports, Transfer, TransferError, TransferLink, TransferQueue,
                                      copy_round, pieces, read_round, read_through)
from moestream.topology import ExpertKey, Topology
from moestream.tracer import Label, LaneTotal, Tracer, expert_names, since
from moestream.transfer_core import TransferCore

__all__ = ["TIERS", "ExpertStore", "StoreStats"]


class ExpertStore:
    def __init__(self, index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
                 host_eviction: EvictionPolicy, integrity: Integrity | None = None, reader: DiskReader | None = None,
                 link: Link | None = None, staging: int | None = None, executor: Executor | None = None,
                 tracer: Tracer | None = None):
        """integrity: checks each expert's bytes just read from disk (e.g. a checkpoint Manifest); reader
        and link replace the disk reader and the host -> device copy link (default: made for config);
        staging: pinned slots disk reads pass through on their way up (default: `staging_slots`);
        executor: where the links' rounds run (default: `executor_for(config)`); tracer: told of the
        waits and of each link's rounds (default: one of its own)."""
        self.index, self.integrity, self.config = index, integrity, config
        self.topology: Topology = index.topology
        check_index(index)
        self.device_slots, self.host_slots = config.device_slots(self.topology), config.host_slots(self.topology)
        self._device, self._host = make_tiers(config, self.topology, device_eviction, host_eviction)
        staging = staging_slots(config, self.topology) if staging is None else staging
        self._bounce = SlotPool(staging, self.topology.expert_bytes, "cpu", pin_memory=config.uses_cuda)
        self.reader = reader or DiskReader(direct_io=config.direct_io)  # public: callers may wrap it
        self._residues = {key: index.residue(key, BLOCK_BYTES) for key in index.locations}  # slot placement
        self._link = link or make_link(config.device)  # host -> device
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._core: TransferCore[Transfer] = TransferCore(self._device.cache, self._displaced)
        self.tracer = TimelineTee(tracer or Tracer())
        self._stats, self._since = StoreStats(), self.tracer.totals()
        self._errors: dict[ExpertKey, BaseException] = {}  # failures kept for the thread that waits on them
        self._stale: set[ExpertKey] = set()  # host slots a dropped read still writes
        self._closed = False
        self._links = {link.lane: link for link in self._make_links()}
        self.executor = executor or executor_for(config)
        self.executor.start(self._cond, list(self._links.values()), self.tracer)

    def record_timeline(self, timeline) -> None:
        """Temporary, until the engine hands the store its tracer: the store's spans also go to timeline."""
        self.tracer.timeline = timeline

    # -- the caller's calls ------------------------------------------------------------------------

    def fetch(self, keys: Sequence[ExpertKey], chosen: Sequence[ExpertKey] = ()) -> Fetch:
        """Pins keys in the device tier and brings in the missing ones; the Fetch hands them out as their
        bytes are in place. chosen: every expert the gate chose in these layers (default: keys), which
        the preemption keeps."""
        wanted = list(dict.fromkeys(as_key(k) for k in keys))
        with self._lock:
            self._check_open()
            self._check_fits(wanted)
            self._defer(wanted, {as_key(k) for k in chosen} | set(wanted))
            late, missed = self._core.fetch_layer(wanted)  # pinned until release
            for key in late:  # on its way: promoted to demand (unless it failed meanwhile: next_ready raises)
                self._reprioritise(key, demand=True)
            self._bring(wanted, missed)
        return Fetch(self, wanted)

    def acquire(self, keys: Sequence[ExpertKey]) -> dict[ExpertKey, torch.Tensor]:
        """Pins keys in the device tier; returns their 1-D uint8 slots once their bytes are in place."""
        fetch = self.fetch(keys)
        try:
            return dict(fetch.ready())
        except BaseException:
            fetch.release()
            raise

    def next_ready(self, candidates: Sequence[ExpertKey]) -> tuple[ExpertKey, torch.Tensor]:
        """The first fetched candidate whose bytes are in place (waiting for one to land), with its slot."""
        with self._lock:
            if self._first_ready(candidates) is None:
                with self.tracer.span("wait", lambda: expert_names(candidates)):
                    self._wait(lambda: self._first_ready(candidates) is not None,
                               f"experts {[tuple(k) for k in candidates]}")
            key = self._first_ready(candidates)
            return key, self._slot_of(self._device, key)

    def release(self, keys: Iterable[ExpertKey]) -> None:
        """Unpin experts returned by acquire (once per acquire)."""
        with self._lock:
            self._device.cache.unpin(as_key(k) for k in keys)

    def prefetch(self, requests: Sequence[TransferRequest]) -> list[ExpertKey]:
        """Admits the requested experts by priority and queues their transfers; returns those admitted.
        Raises the failure of any of them that the executor has already moved."""
        with self._lock:
            self._check_open()
            priorities = {as_key(r.key): r.priority for r in requests}
            brought = self._core.admit_prefetches([as_key(r.key) for r in sorted(requests, key=lambda r: -r.priority)])
            for key in priorities.keys() - set(brought):  # under way already: its rank follows the new plan
                self._reprioritise(key, priority=priorities[key])
            brought = [key for key in brought if self._enqueue(key, priorities[key], demand=False)]
            self._stats.prefetched += len(brought)
            self._stats.prefetched_bytes += len(brought) * self.topology.expert_bytes
            self.executor.queued(lambda: "prefetch " + expert_names(brought))
            for key in brought:
                if key in self._errors:
                    raise self._errors.pop(key)
        return brought

    def wait_idle(self) -> None:
        """Blocks until no transfer is in flight (e.g. after a preload); raises the first failure."""
        with self._lock:
            self._wait(lambda: not self._core.moving, f"{len(self._core.moving)} transfers in flight")
            if self._errors:
                error = next(iter(self._errors.values()))
                self._errors.clear()
                raise error

    def close(self) -> None:
        """Stops the executor after its rounds, drops the queued transfers, closes the files."""
        with self._lock:
            self._closed = True
        self.executor.stop()
        with self._cond:
            for transfer in list(self._core.moving.values()):
                self._forget(transfer)
            for link in self._links.values():
                link.queue.drain()
            self._cond.notify_all()
            self._link.synchronize()
            self.reader.close()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plans -----------------------------------------------------------------------------------

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

    # -- views -----------------------------------------------------------------------------------

    def resident(self, tier: str = "device") -> frozenset[ExpertKey]:
        """Experts whose bytes are in place in the tier (those still arriving there excluded)."""
        with self._lock:
            found = self._tier(tier)
            arriving = {key for key, t in self._core.moving.items() if tier == "device" or t.link == DISK}
            return found.cache.resident() - arriving if found is not None else frozenset()

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
            stats, counts = self._stats.copy(), self._core.counts
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
            self._stats, self._since = StoreStats(), self.tracer.totals()
            self._core.reset_counts()

    # -- under the lock: queueing ------------------------------------------------------------------

    def _make_links(self) -> list[TransferLink]:
        """The chain of links that follows the tiers: disk -> device, or disk -> host -> device."""
        reads = LinkReports(self._landed, self._read_failed, self._given_back, self._read_batch)
        disk = TransferLink(DISK, TransferQueue(self.device_slots), partial(read_round, self._read), reads, self.tracer)
        if self._host is None:
            return [disk]
        copies = LinkReports(self._copied, self._copy_failed, self._given_back)
        return [disk, TransferLink(H2D, TransferQueue(self.device_slots), partial(copy_round, self._link), copies,
                                   self.tracer)]

    def _read(self, batch) -> int:
        """The disk reads of a round (self.reader, as callers may have wrapped it since)."""
        return read_through(self.reader.read_batch, batch, self._bounce, self._link)

    def _read_batch(self, experts: int, seconds: float) -> None:
        self._stats.read_fit.add(experts, seconds)

    def _bring(self, wanted: list[ExpertKey], missed: list[ExpertKey]) -> None:
        """Queues the misses' transfers and hands them to the executor; on failure the misses not queued
        leave the tier and the layer's pins go."""
        queued = 0
        try:
            for key in missed:
                self._enqueue(key, 0.0, demand=True)
                queued += 1
            self.executor.queued(lambda: expert_names(wanted))
        except BaseException:
            for key in missed[queued:]:
                self._core.forget(key)
            self._device.cache.unpin(wanted)
            raise

    def _enqueue(self, key: ExpertKey, priority: float, demand: bool) -> bool:
        """Queues the transfer of an expert just admitted (and pinned); False: refused (it left the tier).
        With a host tier, a host hit goes to the copy queue; a miss takes a host slot and goes to the disk queue."""
        self._errors.pop(key, None)
        if self._host is None:
            self._queue(key, DISK, self._slot_of(self._device, key), priority, demand)
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
        self._queue(key, DISK, self._host.pool.slot(slot, self._residues[key]), priority, demand)
        return True

    def _queue_copy(self, key: ExpertKey, priority: float, demand: bool, continued: bool = False) -> None:
        self._queue(key, H2D, self._slot_of(self._device, key), priority, demand, continued,
                    src=self._slot_of(self._host, key))

    def _queue(self, key: ExpertKey, lane: str, dst: torch.Tensor, priority: float, demand: bool,
               continued: bool = False, src: torch.Tensor | None = None) -> None:
        """Queues key's bytes on the lane's link into dst (1-D uint8), from src or the checkpoint."""
        parts = pieces(self.index.locations[key].segments, self.config.chunk_bytes)
        transfer = Transfer(key, dst, parts, src, priority=priority, demand=demand, continued=continued, link=lane)
        self._links[lane].queue.push(transfer)
        self._core.track(key, transfer)
        self._cond.notify_all()

    def _host_room(self, demand: bool) -> bool:
        """Whether the host tier can take one more expert: a demand waits for a copy to free one."""
        full = lambda: len(self._host.cache) >= self.host_slots and not self._host.cache.has_evictable()
        return self._wait(lambda: not full(), "a free host slot", patient=demand)

    def _defer(self, wanted: list[ExpertKey], chosen: set[ExpertKey]) -> None:
        """Queued speculative transfers of the wanted experts' layers that the gate did not choose go
        to the back of their queue (their experts keep their slots)."""
        layers = {k.layer for k in wanted}
        for link in self._links.values():
            for transfer in link.queue.speculative():
                if transfer.key.layer in layers and transfer.key not in chosen:
                    link.queue.reprioritise(transfer, priority=float("-inf"))

    def _reprioritise(self, key: ExpertKey, priority: float | None = None, demand: bool = False) -> None:
        transfer = self._core.moving.get(key)
        if transfer is not None:
            self._links[transfer.link].queue.reprioritise(transfer, priority, demand)

    # -- under the lock: landing, failing, displacing ------------------------------------------------

    def _landed(self, transfer: Transfer) -> None:
        """A read's bytes are in its slot: checked, then on to the copy link or in place."""
        if not self._verified(transfer, self._host or self._device):
            return
        self._stats.host_misses += 1
        if self._host is not None:  # on to the host -> device link, with its demand and priority
            self._queue_copy(transfer.key, transfer.priority, transfer.demand, continued=True)
            return
        self._core.landed(transfer.key, transfer)
        self._cond.notify_all()

    def _copied(self, copy: Transfer) -> None:
        if not self._core.landed(copy.key, copy):
            return  # displaced, or forgotten by close()
        self._host.cache.unpin([copy.key])
        self._stats.bytes_read["host"] += self.topology.expert_bytes
        self._cond.notify_all()

    def _verified(self, transfer: Transfer, tier: Tier) -> bool:
        """Whether a landed read is still wanted and its bytes in tier's slot pass the integrity check (if
        not, the transfer has failed). A damaged expert fails here, before any slot holding it is used."""
        if self._core.moving.get(transfer.key) is not transfer:
            return False  # displaced, or forgotten by close()
        self._stats.bytes_read["disk"] += self.topology.expert_bytes
        try:
            if self.integrity is not None:
                self.integrity.check_batch([transfer.key], [self._slot_of(tier, transfer.key)])
        except CheckpointError as error:
            self._read_failed(transfer, error)
            return False
        return True

    def _read_failed(self, transfer: Transfer, error: BaseException) -> None:
        self._fail(transfer, error, f"reading expert {tuple(transfer.key)} from disk failed")

    def _copy_failed(self, copy: Transfer, error: BaseException) -> None:
        self._fail(copy, error, f"copying expert {tuple(copy.key)} from host to device failed")

    def _fail(self, transfer: Transfer, error: BaseException, what: str) -> None:
        """The error kept for the thread that waits on the transfer's expert, which leaves the tier."""
        if self._core.moving.get(transfer.key) is transfer:
            failure = error if isinstance(error, CheckpointError) else TransferError(f"{what}: {error}")
            failure.__cause__ = None if failure is error else error
            self._errors[transfer.key] = failure
            self._forget(transfer)
        self._cond.notify_all()

    def _displaced(self, transfer: Transfer) -> None:
        """The core evicted the transfer's expert: cancelled if queued, else moved no further once its
        round ends. Its slot is safe to reuse at once: whatever is queued into it next goes on the same
        link, after that round."""
        if transfer.link == DISK and transfer.held and self._host is not None:
            self._stale.add(transfer.key)  # not a host hit until the read lets go of its slot
        transfer.dropped = True
        if self._links[transfer.link].queue.cancel(transfer.key) is transfer:
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

    # -- under the lock: helpers ------------------------------------------------------------------

    def _first_ready(self, candidates: Sequence[ExpertKey]) -> ExpertKey | None:
        """The first candidate in place; raises the failure of any before it."""
        self._check_open()
        for key in candidates:
            if key in self._errors:
                raise self._errors.pop(key)
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

    def _slot_of(self, tier: Tier, key: ExpertKey) -> torch.Tensor:
        """key's slot in tier, placed so that its disk reads land in place."""
        return tier.slot(key, self._residues[key])

    def _tier(self, tier: str) -> Tier | None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        return self._device if tier == "device" else self._host


class TimelineTee:
    """Temporary, until the engine hands the store its tracer (then it goes, with `record_timeline`): the
    tracer, each span also added to a `moestream.timeline.Timeline` when one is set."""

    span = Tracer.span

    def __init__(self, tracer: Tracer):
        self.tracer, self.timeline = tracer, None

    def add(self, lane: str, label: Label, begin_s: float, end_s: float) -> float:
        timeline = self.timeline  # read once: the compute thread may reset it
        if timeline is not None:
            timeline.add(lane, label() if callable(label) else label, begin_s, end_s)
        return self.tracer.add(lane, label, begin_s, end_s)

    def totals(self) -> dict[str, LaneTotal]:
        return self.tracer.totals()
