"""The chain of links that follows the store's tiers, and the one place a transfer is queued, lands,
fails or is displaced: the mechanism the engine's store and the simulator both run.

Links follow the tiers (`moestream.store.transfer`): disk -> device for one tier; disk -> host ->
device where a host tier is kept apart (CUDA: pinned host slots below GPU memory). There a host hit
goes straight to the copy queue; a miss takes a host slot, is read into it, then re-queued on the copy
link with its demand and priority, so that one expert's read overlaps another's copy up. Every read is
checked (integrity) where it lands in host memory, by the disk link's round, so a device slot is never
read back. The host tier keeps the copy and evicts by its own policy; a host slot stays pinned while
the disk writes it and until its copy up is issued; a read that reuses it waits for that copy (the
slot's last reader), as a copy into a device slot waits on its stream for the compute that last read
the slot (`read_by`). A landed expert's slot carries the event its readers wait for (`arrival`). A
demand miss that finds every host slot pinned waits for a copy; a speculative one is refused unless
the wait can move the copy itself (the inline executor): the one residency rule that may depend on
the clock.

Calls: `fetch` (a layer's lookups: the queued speculation of its layer that the gate did not choose
goes to the back (`defer`), its in-flight experts become demand where they are (`promote`)), `bring`
(its misses queued as demand) and `prefetch` (a plan's admissions queued by priority). Residency is
the transfer core's (`moestream.transfer_core`), which the chain drives: an expert is in the device
tier from its admission, whether its bytes have landed or not. Life of a transfer: queued (in flight,
until its bytes are in the device slot or their last copy there is issued), then landed, or failed
(the expert leaves the tier, the error kept in `errors` for the thread that waits on it). A transfer
whose expert the core evicts (`_displaced`) is cancelled if queued (a cancelled read frees its host
slot, a cancelled copy keeps the host copy), else moved no further once its round ends. Slots and
events are handles of the tiers' pools (`Tier`): the engine's are tensors and stream events, the
simulator's move nothing. Everything here runs under the caller's lock; it knows no clock, no torch,
no thread, no policy and no device type.
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
    """A tier: which experts it holds (its cache, by its eviction policy) and the slots their bytes are in (the
    engine's `SlotPool`, the simulator's handles: slot, last_read, written, mark_read, mark_written)."""

    cache: ExpertCache
    pool: Any

    def slot(self, key: ExpertKey, residue: int) -> Any:
        """The resident key's slot, starting residue bytes into its row (disk reads land in place)."""
        return self.pool.slot(self.cache.slot(key), residue)


class LinkChain:
    def __init__(self, parts: Parts, residues: Mapping[ExpertKey, int], tiers: tuple[Tier, Tier | None],
                 integrity: Integrity | None, cond: threading.Condition, wait: Wait, expert_bytes: int):
        """parts: each expert's chunks; residues: where each expert's bytes start in its slot; tiers: the
        device tier and the host tier (None: none); cond: the caller's; wait: how the caller waits (for a
        host slot)."""
        self._parts, self._residues, self.integrity, self.expert_bytes = parts, residues, integrity, expert_bytes
        self.device, self.host = tiers
        self.core: TransferCore[Transfer] = TransferCore(self.device.cache, self._displaced)
        self.stats = StoreStats()  # the counters the chain keeps (the store adds the core's and the times)
        self.errors: dict[ExpertKey, BaseException] = {}  # failures kept for the thread that waits on them
        self.links: dict[str, TransferLink] = {}
        self._stale: set[ExpertKey] = set()  # host slots a dropped read still writes
        self._cond, self._wait = cond, wait

    def make_links(self, read: Move, copy: Move) -> list[TransferLink]:
        """The chain of links that follows the tiers: disk -> device, or disk -> host -> device (the copy
        link only with a host tier); read and copy: their copy functions."""
        reads = LinkReports(self._landed, self._read_failed, self._read_released,
                            lambda experts, seconds: self.stats.read_fit.add(experts, seconds))
        chain = [TransferLink(DISK, TransferQueue(self.device.cache.capacity), read, reads)]
        if self.host is not None:
            copies = LinkReports(self._copied, self._copy_failed, self._copy_released)
            chain.append(TransferLink(H2D, TransferQueue(self.device.cache.capacity), copy, copies))
        self.links = {link.lane: link for link in chain}
        return chain

    # -- the calls -------------------------------------------------------------------------------

    def fetch(self, wanted: list[ExpertKey], chosen: set[ExpertKey]) -> tuple[list[ExpertKey], list[ExpertKey]]:
        """A layer's lookups (the core's `fetch_layer`: wanted pinned, the misses admitted): first the
        speculation of its layers that the gate did not choose is deferred, then the experts still on their
        way are promoted to demand. Returns (late, missed): the misses are for `bring`."""
        self.defer(wanted, chosen | set(wanted))
        late, missed = self.core.fetch_layer(wanted)
        self.promote(late)
        return late, missed

    def promote(self, late: Iterable[ExpertKey]) -> None:
        """Experts on their way that a layer needs: demand, where they are queued or moving."""
        for key in late:
            self.reprioritise(key, demand=True)

    def bring(self, wanted: list[ExpertKey], missed: list[ExpertKey]) -> None:
        """Queues the misses as demand transfers; on failure the misses not queued leave the tier and the
        layer's pins (wanted) go."""
        queued = 0
        try:
            for key in missed:
                self.enqueue(key, 0.0, demand=True)
                queued += 1
        except BaseException:
            for key in missed[queued:]:
                self.core.forget(key)
            self.device.cache.unpin(wanted)
            raise

    def prefetch(self, priorities: dict[ExpertKey, float]) -> list[ExpertKey]:
        """A plan's requests (priority by expert): admitted by the core best first, those admitted queued,
        those under way already re-ranked. Returns those queued (one the chain refuses has left the tier);
        on failure (e.g. Ctrl-C in an inline round) those not yet queued leave the tier."""
        admitted = self.core.admit_prefetches(sorted(priorities, key=lambda key: -priorities[key]))
        for key in priorities.keys() - set(admitted):  # under way already: its rank follows the new plan
            self.reprioritise(key, priority=priorities[key])
        brought, done = [], 0
        try:
            for key in admitted:
                if self.enqueue(key, priorities[key], demand=False):
                    brought.append(key)
                done += 1
        except BaseException:
            for key in admitted[done:]:
                self.core.forget(key)
            raise
        self.stats.prefetched += len(brought)
        self.stats.prefetched_bytes += len(brought) * self.expert_bytes
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
        """Queues the transfer of an expert just admitted (and pinned); False: refused (it left the tier).
        With a host tier, a host hit goes to the copy queue; a miss takes a host slot and goes to the disk queue."""
        self.errors.pop(key, None)
        if self.host is None:
            self._queue(key, DISK, self.device, priority, demand)
            return True
        if key not in self._stale and self.host.cache.access(key) is not None:
            self.stats.host_hits += 1
            self.host.cache.pin([key])  # the copy's pin
            self._queue_copy(key, priority, demand)
            return True
        if not self._host_room(demand):
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
        """Queues key's bytes on the lane's link into its slot in tier, from src or the checkpoint (checked
        as they are read), after the slot's last reader."""
        check = self.integrity.begin(key) if lane == DISK and self.integrity is not None else None
        transfer = Transfer(key, self.slot(tier, key), self._parts(key), src, priority=priority, demand=demand,
                            link=lane, after=tier.pool.last_read(tier.cache.slot(key)), check=check, staged=staged)
        self.links[lane].queue.push(transfer)
        self.core.track(key, transfer)
        self._cond.notify_all()

    def _host_room(self, demand: bool) -> bool:
        """Whether the host tier can take one more expert: a demand waits for a copy to free one."""
        full = lambda: len(self.host.cache) >= self.host.cache.capacity and not self.host.cache.has_evictable()
        return self._wait(lambda: not full(), "a free host slot", demand)

    def defer(self, wanted: list[ExpertKey], chosen: set[ExpertKey]) -> None:
        """Queued speculative transfers of the wanted experts' layers that the gate did not choose go
        to the back of their queue (their experts keep their slots)."""
        layers = {k.layer for k in wanted}
        for link in self.links.values():
            for transfer in link.queue.speculative():
                if transfer.key.layer in layers and transfer.key not in chosen:
                    link.queue.reprioritise(transfer, priority=float("-inf"))

    def reprioritise(self, key: ExpertKey, priority: float | None = None, demand: bool = False) -> None:
        transfer = self.core.moving.get(key)
        if transfer is not None:
            self.links[transfer.link].queue.reprioritise(transfer, priority, demand)

    # -- the links' reports: landing, failing, displacing --------------------------------------------

    def _landed(self, transfer: Transfer) -> None:
        """A read's bytes are in its slot (or on their way up from staging), every chunk checked: on to the
        copy link, or in place."""
        if not self._verified(transfer):
            return
        self.stats.host_misses += 1
        if self.host is not None:  # on to the host -> device link, with its demand and priority
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
        """Whether a landed read is still wanted and its integrity check saw every byte (the round checked
        each chunk in host memory; a damaged expert failed there, before any slot holding it was used)."""
        if self.core.moving.get(transfer.key) is not transfer:
            return False  # displaced, or forgotten by close()
        self.stats.bytes_read["disk"] += self.expert_bytes
        if transfer.check is not None and not transfer.check.done:
            self._read_failed(transfer, TransferError("its integrity check did not see every byte"))
            return False
        return True

    def _read_failed(self, transfer: Transfer, error: BaseException) -> None:
        self._fail(transfer, error, f"reading expert {tuple(transfer.key)} from disk failed")

    def _copy_failed(self, copy: Transfer, error: BaseException) -> None:
        self._fail(copy, error, f"copying expert {tuple(copy.key)} from host to device failed")

    def _fail(self, transfer: Transfer, error: BaseException, what: str) -> None:
        """The error kept for the thread that waits on the transfer's expert, which leaves the tier."""
        if self.core.moving.get(transfer.key) is transfer:
            failure = error if isinstance(error, CheckpointError) else TransferError(f"{what}: {error}")
            failure.__cause__ = None if failure is error else error
            self.errors[transfer.key] = failure
            self.forget(transfer)
        self._cond.notify_all()

    def _displaced(self, transfer: Transfer) -> None:
        """The core evicted the transfer's expert: cancelled if queued, else moved no further once its
        round ends. Its slot is safe to reuse at once: whatever is queued into it next goes on the same
        link, after that round."""
        if transfer.link == DISK and transfer.held and self.host is not None:
            self._stale.add(transfer.key)  # not a host hit until the read lets go of its slot
        transfer.dropped = True
        if self.links[transfer.link].queue.cancel(transfer.key) is transfer:
            self.stats.cancelled += 1
            self._given_back(transfer)
        elif not transfer.held:  # between the stages of a tiered transfer: nothing holds it
            self._given_back(transfer)

    def _given_back(self, transfer: Transfer) -> None:
        """What a transfer held besides its device slot, given back (its link's own release)."""
        self.links[transfer.link].reports.released(transfer)

    def _copy_released(self, copy: Transfer) -> None:
        """A copy's host pin given back (its host copy stays); whatever overwrites the host slot waits for
        the copy."""
        if copy.event is not None:
            self.host.pool.mark_read(self.host.cache.slot(copy.key), copy.event)
        self.host.cache.unpin([copy.key])

    def _read_released(self, transfer: Transfer) -> None:
        """A dropped read's expert leaves the host tier (its bytes may not be whole) unless a new read
        fills it again."""
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

    # -- under the lock: helpers ------------------------------------------------------------------

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
        """key's slot in tier, placed so that its disk reads land in place."""
        return tier.slot(key, self._residues[key])

