"""The transfer core: the bookkeeping of experts coming into the device tier, one clock-free object
that the engine's stores (`moestream.store`) and the simulator (`moestream.bench.sim.engine`) both drive.

Residency changes only at a layer's lookups (`fetch_layer`) and at a plan (`plan_view`,
`admit_prefetches`, `end_plan`), never when bytes land (docs/design.md, "The transfer core"); an
expert evicted while it moves is handed to its driver (`displaced`). It also builds the planner's
view and feeds a `ModelledLink`. It knows no time, no bytes, no thread and no policy by name.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from moestream.cache import CacheFullError, ExpertCache
from moestream.contracts import CacheView, LinkState
from moestream.link_model import ModelledLink
from moestream.topology import ExpertKey

HIT, LATE, MISS = "hit", "late", "miss"
Record = TypeVar("Record")  # a driver's record of one transfer (the core never looks inside)


@dataclass
class TransferCounts:
    hits: int = 0  # lookups whose expert was in the tier, landed or late
    late: int = 0  # hits whose expert was still moving (its wait is stall)
    misses: int = 0  # lookups whose expert was not in the tier (a demand load)
    prefetched: int = 0  # experts a plan admitted
    prefetch_hits: int = 0  # first lookups of a prefetched expert that had landed (never a late one)
    wasted: int = 0  # prefetched experts evicted before any lookup
    evictions: int = 0  # experts evicted from the tier


class TransferCore(Generic[Record]):
    def __init__(self, device: ExpertCache, displaced: Callable[[Record], None] = lambda record: None,
                 link: ModelledLink | None = None):
        """displaced: told of a transfer whose expert left the tier while it moved; link: for the view."""
        self.device, self.displaced, self.link = device, displaced, link
        self.moving: dict[ExpertKey, Record] = {}  # the driver's transfers not yet landed
        self.plan: list[ExpertKey] = []  # the current plan's admissions, best first, pinned until the next
        self.last: set[ExpertKey] = set()  # the previous plan's admissions no lookup had used when it ended
        self.unused: set[ExpertKey] = set()  # prefetched experts no lookup has used yet
        self.demanded: set[ExpertKey] = set()  # the looked-up layer's misses
        self.counts = TransferCounts()
        self._layer = -1  # the layer of the last lookup

    def lookup(self, key: ExpertKey) -> str:
        """A layer needs key: HIT (in the tier and landed), LATE (in the tier, still moving: the
        mechanism makes it demand and waits), both accessed and counted as hits; or MISS (not in the
        tier: `admit_demand` next)."""
        if key.layer != self._layer:
            self._layer, self.demanded = key.layer, set()
        if self.device.access(key) is None:
            self.counts.misses += 1
            return MISS
        late, counts = key in self.moving, self.counts
        if self.link is not None:
            self.link.need(key)
        counts.hits += 1
        counts.late += late
        if key in self.unused:
            self.unused.discard(key)
            counts.prefetch_hits += not late
        return LATE if late else HIT

    def fetch_layer(self, keys: Sequence[ExpertKey]) -> tuple[list[ExpertKey], list[ExpertKey]]:
        """A layer's lookups: every key pinned (until it has computed), looked up, each miss admitted; returns
        (late, missed): the keys still moving, and those to load."""
        self.device.pin(keys)
        found = [self.lookup(key) for key in keys]
        missed = [key for key, f in zip(keys, found) if f == MISS]
        self.admit_demands(missed, keys)
        return [key for key, f in zip(keys, found) if f == LATE], missed

    def admit_demands(self, keys: list[ExpertKey], pinned: list[ExpertKey]) -> None:
        """Admits each key as a demand load; on CacheFullError those admitted leave, `pinned` is unpinned."""
        admitted = []
        try:
            for key in keys:
                self.admit_demand(key)
                admitted.append(key)
        except CacheFullError:
            for key in admitted:
                self.forget(key)
            self.device.unpin(pinned)
            raise

    def admit_demand(self, key: ExpertKey) -> None:
        """A missed expert's slot (and a use), releasing the plan's pins (worst first) while none is evictable."""
        while len(self.device) >= self.device.capacity and not self.device.has_evictable() and self.plan:
            self.device.unpin((self.plan.pop(),))
        self.admit(key)
        self.device.access(key)
        self.demanded.add(key)
        if self.link is not None:
            self.link.demand(key)

    def plan_view(self, layer_now: int, num_layers: int) -> CacheView:
        """Ends the previous plan and returns the tier as the next planner sees it: in flight, the
        previous plan's admissions no lookup has used and the layer's demand loads; resident, the rest
        of the tier (both by events, not by landings)."""
        in_flight = frozenset(self.unused.intersection(self.plan)) | self.demanded
        self.end_plan()
        return CacheView(self.device.resident() - in_flight, in_flight, self.device.capacity, layer_now, num_layers,
                         self.link_state(layer_now))

    def link_state(self, layer_now: int) -> LinkState | None:
        """The modelled link as a plan after layer_now sees it (None without a model)."""
        return None if self.link is None else self.link.state(layer_now)

    def end_plan(self) -> None:
        """The previous plan's pins are released; its experts keep their slots until evicted."""
        self.device.unpin(self.plan)
        self.last = self.unused.intersection(self.plan)
        self.plan, self.demanded = [], set()

    def admit_prefetches(self, keys: Sequence[ExpertKey]) -> list[ExpertKey]:
        """The one prefetch admission rule, applied when a plan is made (after `plan_view` or `end_plan`):
        in the plan's order (best first), each expert not in the tier takes a slot, pinned until the next
        plan, evicting by policy any unpinned expert but those the plan asked for earlier and those the
        previous plan brought that no lookup has used yet; stops at the first that finds no victim.
        Returns the experts admitted, in order."""
        device, kept, brought = self.device, [], []
        if self.plan:  # a plan made without a view (a preload) ends the last one too
            self.end_plan()
        for key in keys:
            if key in device:
                device.pin((key,))
                kept.append(key)
                continue
            try:
                self.admit(key, protect=self.last)
            except CacheFullError:
                break
            device.pin((key,))
            brought.append(key)
            self.unused.add(key)
            self.counts.prefetched += 1
        device.unpin(kept)
        if self.link is not None:
            self.link.speculate(brought)
        self.plan = list(brought)  # a copy: the caller may forget some of brought while it walks it
        return brought

    def admit(self, key: ExpertKey, protect: Container[ExpertKey] = ()) -> None:
        """A slot for key, evicting by policy (never a pinned or protected expert; a moving one is displaced)."""
        _, evicted = self.device.admit(key, protect)
        if evicted is None:
            return
        self.counts.evictions += 1
        if evicted in self.unused:
            self.unused.discard(evicted)
            self.counts.wasted += 1
        if self.link is not None:  # landed or not: the model must not depend on the clock
            self.link.drop(evicted)
        record = self.moving.pop(evicted, None)
        if record is not None:
            self.displaced(record)

    def track(self, key: ExpertKey, record: Record) -> None:
        """key, in the tier, is on its way (queued or moving); record is the driver's transfer."""
        self.moving[key] = record

    def landed(self, key: ExpertKey, record: Record) -> bool:
        """record's bytes are in place; False when it no longer stands for key (displaced or forgotten)."""
        if self.moving.get(key) is not record:
            return False
        del self.moving[key]
        return True

    def forget(self, key: ExpertKey) -> None:
        """key's bytes will not arrive (a failed transfer, a closed store): it leaves the tier."""
        self.moving.pop(key, None)
        self.unused.discard(key)
        if self.link is not None:
            self.link.drop(key)
        if key in self.plan:
            self.plan.remove(key)
        if key in self.device:
            self.device.remove(key)

    def reset_counts(self) -> None:
        self.counts = TransferCounts()
        self.unused.clear()
