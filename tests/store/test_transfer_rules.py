"""The rules every store kind keeps, through public seams only: a needed transfer is promoted to demand
and served next, a late prefetch is a hit but no prefetch hit, a pinned expert's slot keeps its bytes,
and a new plan releases the previous plan's pins while its transfers go on (the `PrefetchPlanner`
contract): residency changes at lookups and plans, never at a landing."""

import threading

import pytest

from moestream.contracts import TransferRequest
from moestream.policies.eviction import LRUPolicy
from moestream.store import ExpertStore, StoreConfig
from moestream.store.disk import DiskReader
from moestream.store.factory import open_store
from moestream.topology import ExpertKey
from tests.store.test_store import assert_holds_expert

K = ExpertKey
KINDS = ("sync", "async", "tiered")


class OrderedGates:
    """The disk reader, each read held until the test lets its experts through (`open`); `reads` holds
    the experts of each read, in the order the reads began."""

    def __init__(self, index, opened=()):
        self.inner, self.opened, self.reads, self.cond = DiskReader(direct_io=False), set(opened), [], threading.Condition()
        self.owner = {(seg.file, seg.offset): key for key, loc in index.locations.items() for seg in loc.segments}

    def read_batch(self, batch):
        keys = {self.owner.get((seg.file, seg.offset)) for segments, _ in batch for seg in segments}
        with self.cond:
            self.reads.append(keys)
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: keys <= self.opened, 10), f"experts {keys} were never let through"
        return self.inner.read_batch(batch)

    def wait_reading(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: any(key in keys for keys in self.reads), 10), f"reads: {self.reads}"

    def open(self, *keys):
        with self.cond:
            self.opened.update(keys)
            self.cond.notify_all()

    def close(self):
        self.inner.close()


def make(kind, ckpt, device_slots, reader, host_slots=4):
    eb = ckpt.index.topology.expert_bytes
    host = host_slots * eb if kind == "tiered" else 0
    config = StoreConfig(device_slots * eb, host, asynchronous=kind != "sync", transfer_timeout_s=10.0)
    if kind == "tiered":  # on the CPU open_store merges the tiers: build the two-tier store itself
        return ExpertStore(ckpt.index, config, LRUPolicy(), LRUPolicy(), reader=reader)
    return open_store(ckpt.index, config, LRUPolicy(), LRUPolicy(), reader=reader)


def every_key(ckpt):
    return list(ckpt.index.topology.keys())


@pytest.mark.parametrize("kind", ["async", "tiered"])
def test_a_queued_speculative_transfer_the_gate_needs_is_promoted_and_read_next(checkpoint, kind):
    gates = OrderedGates(checkpoint.index)
    with make(kind, checkpoint, device_slots=6, reader=gates) as store:
        store.prefetch([TransferRequest(K(1, 3), 0.9)])
        gates.wait_reading(K(1, 3))  # the disk worker holds K(1, 3) until the gates open
        store.prefetch([TransferRequest(K(1, 3), 0.9), TransferRequest(K(0, 0), 0.8),
                        TransferRequest(K(0, 1), 0.7), TransferRequest(K(1, 2), 0.1)])
        fetch = store.fetch([K(1, 2)], chosen=[K(1, 2)])  # queued last, now needed by the gate
        gates.open(*every_key(checkpoint))
        got = dict(fetch.ready())
        fetch.release()
        store.wait_idle()
        assert gates.reads[1] == {K(1, 2)}  # the next read after the one under way
        assert_holds_expert(checkpoint, got[K(1, 2)], K(1, 2))
        stats = store.stats()
        assert (stats.late, stats.hits, stats.misses, stats.prefetch_hits) == (1, 1, 0, 0)


@pytest.mark.parametrize("kind", ["async", "tiered"])
def test_a_late_prefetch_is_a_late_hit_and_never_a_prefetch_hit(checkpoint, kind):
    gates = OrderedGates(checkpoint.index)
    with make(kind, checkpoint, device_slots=4, reader=gates) as store:
        store.prefetch([TransferRequest(K(0, 1), 0.9), TransferRequest(K(0, 2), 0.8)])
        gates.wait_reading(K(0, 1))
        fetch = store.fetch([K(0, 1)])  # its bytes are still on their way
        gates.open(*every_key(checkpoint))
        list(fetch.ready())
        fetch.release()
        store.wait_idle()
        for keys in ([K(0, 1)], [K(0, 2)]):  # K(0, 1) used before; K(0, 2) landed unused: a prefetch hit
            store.release(store.acquire(keys))
        stats = store.stats()
        assert (stats.late, stats.prefetch_hits, stats.hits, stats.misses) == (1, 1, 3, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_pinned_experts_slot_keeps_its_bytes_while_its_layer_computes(checkpoint, kind):
    gates = OrderedGates(checkpoint.index, opened=every_key(checkpoint))
    with make(kind, checkpoint, device_slots=4, reader=gates, host_slots=2) as store:
        layer = [K(0, 0), K(0, 1)]
        fetch = store.fetch(layer, chosen=layer)
        slots = dict(fetch.ready())  # pinned until release: the layer computes from these slots
        for e in range(4):  # later layers' transfers press on every other slot meanwhile
            store.prefetch([TransferRequest(K(1, x), 1.0 - x / 10) for x in range(4)] + [TransferRequest(K(0, e), 0.5)])
            store.release(store.acquire([K(1, e), K(1, 3 - e)]))
            store.wait_idle()
        assert set(layer) <= store.resident()  # no eviction took a pinned expert's slot
        for key in layer:
            assert_holds_expert(checkpoint, slots[key], key)
        fetch.release()


@pytest.mark.parametrize("kind", ["async", "tiered"])
def test_a_new_plan_keeps_the_previous_plans_prefetches_unpinned_and_their_transfers_go_on(checkpoint, kind):
    gates = OrderedGates(checkpoint.index)
    with make(kind, checkpoint, device_slots=5, reader=gates, host_slots=5) as store:
        store.prefetch([TransferRequest(K(1, 3), 0.9)])
        gates.wait_reading(K(1, 3))  # under way
        store.prefetch([TransferRequest(K(0, 0), 0.8), TransferRequest(K(0, 1), 0.7)])  # queued behind it
        assert store.in_flight() == {K(1, 3), K(0, 0), K(0, 1)} and store.pinned() == {K(0, 0), K(0, 1)}
        view = store.plan_view(layer_now=0)  # the next plan: the last one's pins go, its experts stay
        assert view.in_flight == {K(0, 0), K(0, 1)} and view.resident == {K(1, 3)} and not store.pinned()
        store.prefetch([TransferRequest(K(0, 2), 0.5), TransferRequest(K(1, 0), 0.4)])
        assert store.stats().cancelled == 0 and store.pinned() == {K(0, 2), K(1, 0)}
        gates.open(*every_key(checkpoint))
        store.wait_idle()
        assert store.resident() == {K(1, 3), K(0, 0), K(0, 1), K(0, 2), K(1, 0)}
        assert store.stats().prefetched == 5
