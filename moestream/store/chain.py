"""The chain of links that follows the store's tiers, and the one place a transfer is queued, lands,
fails or is displaced: the mechanism the engine's store and the simulator both run.

Links: disk -> device for one tier; disk -> host -> device where a host tier is kept apart (CUDA:
pinned host slots below GPU memory). There a host hit goes straight to the copy queue; a miss takes a
host slot, is read into it, then re-queued on the copy link with its demand and priority, so that one
expert's read overlaps another's copy up. Every read is checked (integrity) where it lands in host
memory, so a device slot is never read back. A host slot stays pinned while the disk writes it and
until its copy up is issued; a read that reuses it waits for that copy, as a copy into a device slot
waits for the compute that last read the slot (`read_by`). A landed expert's slot carries the event
its readers wait for (`arrival`). A demand miss that finds every host slot pinned waits for a copy; a
speculative one is refused unless the wait can move the copy itself (the inline executor): the one
residency rule that may depend on the clock.

Residency is the transfer core's (`moestream.transfer_core`): an expert is in the device tier from its
admission. A transfer is queued until its bytes are in the device slot (or their last copy there is
issued), then landed, or failed (the expert leaves the tier, the error kept in `errors` for the thread
that waits on it). One whose expert the core evicts is cancelled if queued, else moved no further once
its round ends. Slots and events are handles of the tiers' pools (`Tier`): tensors and stream events in
the engine, nothing in the simulator. Runs under the caller's lock; knows no clock, no torch, no thread,
no policy and no device type.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from moestream.cache import ExpertCache
from moestream.errors import CheckpointError
from moestream.store.stats import StoreStats
from moestream.store.transfer import (
    DISK,
    H2D,
    Errors,
    Held,
    LinkReports,
    Transfer,
    TransferError,
    TransferLink,
    TransferQueue,
)
from moestream.topology import ExpertKey
from moestream.transfer_core import TransferCore

if TYPE_CHECKING:
    from moestream.checkpoint.layout import Integrity

Wait = Callable[[Callable[[], bool], str, bool], bool]  # the executor's wait: (ready, what, patient) -> ready
Parts = Callable[[ExpertKey], list]  # an expert's chunks, [(Segment, offset in its slot)] (`transfer.pieces`)
Move = Callable[[Held], Errors]  # a link's copy function


@dataclass
class Tier:
    """Which experts a tier holds (its cache) and the slots of their bytes (`SlotPool`, or the simulator's)."""

    cache: ExpertCache
    pool: Any

    def slot(self, key: ExpertKey, residue: int) -> Any:
        """The resident key's slot, starting residue bytes into its row."""
        return self.pool.slot(self.cache.slot(key), residue)


class LinkChain:
    def __init__(self, parts: Parts, residues: Mapping[ExpertKey, int], tiers: tuple[Tier, Tier | None],
                 integrity: Integrity | None, cond: threading.Condition, wait: Wait, expert_bytes: int):
        """residues: where each expert's bytes start in its slot; tiers: device, host (None: none)."""
        self._parts, self._residues, self.integrity, self.expert_bytes = parts, residues, integrity, expert_bytes
        self.device, self.host = tiers
        self.core: TransferCore[Transfer] = TransferCore(self.device.cache, self._displaced)
        self.stats = StoreStats()  # the counters the chain keeps (the store adds the core's and the times)
        self.errors: dict[ExpertKey, BaseException] = {}  # failures kept for the thread that waits on them
        self.links: dict[str, TransferLink] = {}
        self._stale: set[ExpertKey] = set()  # host slots a dropped read still writes
        self._cond, self._wait = cond, wait

    def make_links(self, read: Move, copy: Move) -> list[TransferLink]:
        """The links, disk first (the copy link only with a host tier); read, copy: their copy functions."""
        reads = LinkReports(self._landed, self._failed, self._read_released,
                            lambda experts, seconds: self.stats.read_fit.add(experts, seconds))
        chain = [TransferLink(DISK, TransferQueue(self.device.cache.capacity), read, reads)]
        if self.host is not None:
            copies = LinkReports(self._copied, self._failed, self._copy_released)
            chain.append(TransferLink(H2D, TransferQueue(self.device.cache.capacity), copy, copies))
        self.links = {link.lane: link for link in chain}
        return chain

    def fetch(self, wanted: list[ExpertKey], chosen: set[ExpertKey]) -> tuple[list[ExpertKey], list[ExpertKey]]:
        """A layer's lookups (`fetch_layer`) after `defer`; the late become demand; the misses are for `bring`."""
        self.defer(wanted, chosen | set(wanted))
        late, missed = self.core.fetch_layer(wanted)
        self.promote(late)
        return late, missed

    def promote(self, late: Iterable[ExpertKey]) -> None:
        """Experts on their way that a layer needs: demand, where they are queued or moving."""
        for key in late:
            self.reprioritise(key, demand=True)

    def bring(self, wanted: list[ExpertKey], missed: list[ExpertKey]) -> None:
        """Queues the misses as demand; on failure those not queued leave the tier and wanted's pins go."""
        try:
            self._enqueue_all(missed, lambda key: 0.0, demand=True)
        except BaseException:
            self.device.cache.unpin(wanted)
            raise

    def prefetch(self, priorities: dict[ExpertKey, float]) -> list[ExpertKey]:
        """A plan's requests admitted best first and queued (returned), those under way re-ranked; on failure
        (e.g. Ctrl-C) those not yet queued leave the tier."""
        admitted = self.core.admit_prefetches(sorted(priorities, key=lambda key: -priorities[key]))
        for key in priorities.keys() - set(admitted):  # under way already: its rank follows the new plan
            self.reprioritise(key, priority=priorities[key])
        brought = self._enqueue_all(admitted, priorities.__getitem__, demand=False)
        self.stats.prefetched += len(brought)
        self.stats.prefetched_bytes += len(brought) * self.expert_bytes
        return brought

    def _enqueue_all(self, keys: list[ExpertKey], priority: Callable[[ExpertKey], float],
                     demand: bool) -> list[ExpertKey]:
        """Queues each key's transfer; returns those queued (one the chain refuses has left the tier). On
        failure (e.g. Ctrl-C in an inline round) the key that failed and those after it leave the tier."""
        brought = []
        for i, key in enumerate(keys):
            try:
                if self.enqueue(key, priority(key), demand):
                    brought.append(key)
            except BaseException:
                for rest in keys[i:]:
                    self.core.forget(rest)
                raise
        return brought

    def host_ready(self, key: ExpertKey) -> bool:
        """key's bytes are whole in its host slot (none arriving, no dropped read still writing it)."""
        if self.host is None or key not in self.host.cache or key in self._stale:
            return False
        transfer = self.core.moving.get(key)
        return transfer is None or transfer.link != DISK

    def hold_host(self, keys: Sequence[ExpertKey]) -> list[ExpertKey]:
        """Pins (and counts a use of) those of keys whose bytes are whole in the host tier; returns them."""
        held = [key for key in keys if self.host_ready(key)]
        if held:
            self.host.cache.pin(held)
            for key in held:
                self.host.cache.access(key)
        return held

    def unstarted(self, key: ExpertKey) -> bool:
        """key's transfer is queued on its first link and no chunk of it has moved."""
        transfer = self.core.moving.get(key)
        return transfer is not None and not (transfer.staged or transfer.held or transfer.next_chunk)

    def enqueue(self, key: ExpertKey, priority: float, demand: bool) -> bool:
        """Queues the transfer of an expert just admitted (and pinned); False: refused (it left the tier)."""
        self.errors.pop(key, None)
        if self.host is None:
            self._queue(key, DISK, self.device, priority, demand)
            return True
        if key not in self._stale and self.host.cache.access(key) is not None:
            self.stats.host_hits += 1
            self.host.cache.pin([key])  # the copy's pin
            self._queue_copy(key, priority, demand)
            return True
        full = lambda: len(self.host.cache) >= self.host.cache.capacity and not self.host.cache.has_evictable()
        if not self._wait(lambda: not full(), "a free host slot", demand):  # a demand waits for a copy to free one
            self.core.forget(key)
            return False
        slot, victim = self.host.cache.admit(key)
        self.stats.evictions["host"] += victim is not None
        self.host.cache.pin([key])  # the read's pin, then the copy's
        self._queue(key, DISK, self.host, priority, demand)
        return True

    def _queue_copy(self, key: ExpertKey, priority: float, demand: bool, staged: bool = False) -> None:
        self._queue(key, H2D, self.device, priority, demand, src=self.slot(self.host, key), staged=staged)

    def _queue(self, key: ExpertKey, lane: str, tier: Tier, priority: float, demand: bool, src: Any = None,
               staged: bool = False) -> None:
        """Queues key's bytes on the lane's link into its slot in tier, after the slot's last reader."""
        check = self.integrity.begin(key) if lane == DISK and self.integrity is not None else None
        transfer = Transfer(key, self.slot(tier, key), self._parts(key), src, priority=priority, demand=demand,
                            link=lane, after=tier.pool.last_read(tier.cache.slot(key)), check=check, staged=staged)
        self.links[lane].queue.push(transfer)
        self.core.track(key, transfer)
        self._cond.notify_all()

    def defer(self, wanted: list[ExpertKey], chosen: set[ExpertKey]) -> None:
        """Queued speculation of wanted's layers that the gate did not choose goes to the back (keeping slots)."""
        layers = {k.layer for k in wanted}
        for link in self.links.values():
            for transfer in link.queue.speculative():
                if transfer.key.layer in layers and transfer.key not in chosen:
                    link.queue.reprioritise(transfer, priority=float("-inf"))

    def reprioritise(self, key: ExpertKey, priority: float | None = None, demand: bool = False) -> None:
        transfer = self.core.moving.get(key)
        if transfer is not None:
            self.links[transfer.link].queue.reprioritise(transfer, priority, demand)

    def _landed(self, transfer: Transfer) -> None:
        """A read's bytes are in its slot, every chunk checked: on to the copy link, or in place."""
        if not self._verified(transfer):
            return
        self.stats.host_misses += 1
        if self.host is not None:
            self._queue_copy(transfer.key, transfer.priority, transfer.demand, staged=True)
            return
        self.core.landed(transfer.key, transfer)
        self._arrived(transfer)

    def _copied(self, copy: Transfer) -> None:
        if not self.core.landed(copy.key, copy):
            return  # displaced, or forgotten by close()
        self._copy_released(copy)
        self.stats.bytes_read["host"] += self.expert_bytes
        self._arrived(copy)

    def _arrived(self, transfer: Transfer) -> None:
        """The expert's device slot holds its bytes once transfer's last copy has run (its readers wait)."""
        self.device.pool.mark_written(self.device.cache.slot(transfer.key), transfer.event)
        self._cond.notify_all()

    def _verified(self, transfer: Transfer) -> bool:
        """Whether a landed read is still wanted and its integrity check saw every byte."""
        if self.core.moving.get(transfer.key) is not transfer:
            return False  # displaced, or forgotten by close()
        self.stats.bytes_read["disk"] += self.expert_bytes
        if transfer.check is not None and not transfer.check.done:
            self._failed(transfer, TransferError("its integrity check did not see every byte"))
            return False
        return True

    def _failed(self, transfer: Transfer, error: BaseException) -> None:
        """The error kept for the thread that waits on the transfer's expert, which leaves the tier."""
        how = "reading expert {} from disk" if transfer.link == DISK else "copying expert {} from host to device"
        what = how.format(tuple(transfer.key)) + " failed"
        if self.core.moving.get(transfer.key) is transfer:
            failure = error if isinstance(error, CheckpointError) else TransferError(f"{what}: {error}")
            failure.__cause__ = None if failure is error else error
            self.errors[transfer.key] = failure
            self.forget(transfer)
        self._cond.notify_all()

    def _displaced(self, transfer: Transfer) -> None:
        """The core evicted the expert; its slot is reusable at once (what goes in next takes this link, later)."""
        if transfer.link == DISK and transfer.held and self.host is not None:
            self._stale.add(transfer.key)  # not a host hit until the read lets go of its slot
        transfer.dropped = True
        if self.links[transfer.link].queue.cancel(transfer.key) is transfer:
            self.stats.cancelled += 1
            self._given_back(transfer)
        elif not transfer.held:  # between the stages of a tiered transfer: nothing holds it
            self._given_back(transfer)

    def _given_back(self, transfer: Transfer) -> None:
        self.links[transfer.link].reports.released(transfer)

    def _copy_released(self, copy: Transfer) -> None:
        """A copy's host pin given back (the host copy stays; whatever overwrites it waits for the copy)."""
        if copy.event is not None:
            self.host.pool.mark_read(self.host.cache.slot(copy.key), copy.event)
        self.host.cache.unpin([copy.key])

    def _read_released(self, transfer: Transfer) -> None:
        """A dropped read's expert leaves the host tier (bytes maybe not whole) unless a new read refills it."""
        key = transfer.key
        if self.host is None:
            return
        self._stale.discard(key)
        if key in self.core.moving:
            self.host.cache.unpin([key])
        elif key in self.host.cache:
            self.host.cache.remove(key)

    def forget(self, transfer: Transfer) -> None:
        """The transfer's expert leaves the device tier (its bytes never arrived there)."""
        self.core.forget(transfer.key)
        self._given_back(transfer)

    def arrival(self, key: ExpertKey) -> Any:
        """The event a reader of the landed key's device slot waits for (None: its bytes are there)."""
        return self.device.pool.written(self.device.cache.slot(key))

    def read_by(self, keys: list[ExpertKey], event: Any) -> None:
        """keys' device slots are last read by compute issued up to event: a copy into one waits for it."""
        for key in keys:
            slot = self.device.cache.slot(key)
            if slot is not None:  # not one that failed and left the tier
                self.device.pool.mark_read(slot, event)

    def slot(self, tier: Tier, key: ExpertKey) -> Any:
        return tier.slot(key, self._residues[key])

