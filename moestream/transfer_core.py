"""The transfer core: the bookkeeping of experts on their way into the device tier, one object that
the engine's stores (`moestream.store`) and the simulator (`moestream.sim.engine`) both drive.

It answers a layer's lookups (in place: a hit, and a prefetch hit when a landed prefetch is used for
the first time; on its way: late; else a miss), admits experts to the tier (the tier's eviction
policy picks the victim; a landed prefetch evicted unused is wasted), keeps which experts are on
their way (`moving`, each with its driver's own record of the transfer) and lands them. With a
`ModelledLink` (`moestream.link_model`) it tells the model each lookup and admission, and reports the
model's state for the planner's view (`link_state`). The engine's link workers and the simulator's links differ in who moves the bytes and when (threads in
real time, a cost model in virtual time), not in these rules. Clock-free and device-free: it knows
no time, no bytes, no thread (a caller holds its own lock), and no policy by name.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from moestream.cache import CacheFullError, ExpertCache
from moestream.link_model import ModelledLink
from moestream.policies.contracts import LinkState
from moestream.topology import ExpertKey

HIT, LATE, MISS = "hit", "late", "miss"
Record = TypeVar("Record")  # a driver's record of one transfer (the core never looks inside)


@dataclass
class TransferCounts:
    hits: int = 0  # lookups whose expert was in place
    prefetch_hits: int = 0  # hits on a landed prefetch that nobody had used (never a late one)
    wasted: int = 0  # landed prefetches evicted before any use
    evictions: int = 0  # experts evicted from the tier


class TransferCore(Generic[Record]):
    def __init__(self, device: ExpertCache, link: ModelledLink | None = None):
        self.device = device
        self.link = link  # the modelled link for the planner's view (None: the view has none)
        self.moving: dict[ExpertKey, Record] = {}  # on their way into the tier (admitted or planned)
        self.unused: set[ExpertKey] = set()  # landed prefetches nobody has used yet
        self.waited: set[ExpertKey] = set()  # moving experts a layer looked up (late): no unused prefetch
        self.counts = TransferCounts()

    def lookup(self, key: ExpertKey) -> str:
        """A layer needs key: HIT (in place: accessed and counted), LATE (on its way, `moving[key]`:
        accessed, and whatever lands for it is no unused prefetch), or MISS (a demand load admits it:
        no access)."""
        if key in self.moving:
            self.device.access(key)
            self.waited.add(key)
            self._needed(key)
            return LATE
        if self.device.access(key) is None:
            return MISS
        self._needed(key)
        self.counts.hits += 1
        if key in self.unused:
            self.unused.discard(key)
            self.counts.prefetch_hits += 1
        return HIT

    def admit(self, key: ExpertKey, protect: Container[ExpertKey] = ()) -> None:
        """A slot for key in the tier, evicting by policy (never a pinned or protected expert);
        raises CacheFullError when no victim is allowed."""
        _, evicted = self.device.admit(key, protect)
        if evicted is not None:
            self.counts.evictions += 1
            if evicted in self.unused:
                self.unused.discard(evicted)
                self.counts.wasted += 1

    def admit_demand(self, key: ExpertKey) -> None:
        """A missed expert's slot (evicting by policy any unpinned expert); the miss is a use: accessed.
        Nothing to do for one in the tier already (on its way: its lookup accessed it)."""
        if key not in self.device:
            self.admit(key)
            self.device.access(key)
            if self.link is not None:
                self.link.demand(key)

    def admit_prefetches(self, keys: Sequence[ExpertKey]) -> list[ExpertKey]:
        """The one prefetch admission rule, applied when a plan is made: in the plan's order (best first),
        each expert not in the tier takes a slot, pinned for its transfer until it lands or is forgotten,
        evicting by policy any unpinned expert but those the plan asked for earlier; stops at the first
        that finds no victim. Returns the experts admitted, in order."""
        device, kept, brought = self.device, [], []
        for key in keys:
            if key in device:
                device.pin((key,))
                kept.append(key)
                continue
            try:
                self.admit(key)
            except CacheFullError:
                break
            device.pin((key,))
            brought.append(key)
        device.unpin(kept)
        if self.link is not None:
            self.link.speculate(brought)
        return brought

    def link_state(self, layer_now: int) -> LinkState | None:
        """The modelled link as a plan after layer_now sees it (None without a model)."""
        return None if self.link is None else self.link.state(layer_now)

    def _needed(self, key: ExpertKey) -> None:
        """A lookup found key in the tier or on its way (the same for both, whatever the clock says)."""
        if self.link is not None:
            self.link.need(key)

    def track(self, key: ExpertKey, record: Record) -> None:
        """key is on its way into the tier (queued or moving); record is the driver's transfer."""
        self.moving[key] = record

    def landed(self, key: ExpertKey, prefetch: bool) -> Record | None:
        """key's bytes are in place; a prefetch nobody waited for is unused until a hit uses it."""
        record = self.moving.pop(key, None)
        if prefetch and key not in self.waited:
            self.unused.add(key)
        self.waited.discard(key)
        return record

    def untrack(self, key: ExpertKey) -> None:
        """key's queued transfer is replaced by a load the caller does not track: no longer moving, but
        still in the tier."""
        self.moving.pop(key, None)
        self.waited.discard(key)

    def forget(self, key: ExpertKey) -> None:
        """key will not land (dropped, cancelled or failed): it leaves the tier if admitted."""
        self.untrack(key)
        self.unused.discard(key)
        if key in self.device:
            self.device.remove(key)

    def reset_counts(self) -> None:
        self.counts = TransferCounts()
        self.unused.clear()
