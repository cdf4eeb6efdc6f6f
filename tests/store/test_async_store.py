import os
import random
import threading
import time

import pytest

from moestream.contracts import TransferRequest
from moestream.policies.eviction import LRUPolicy
from moestream.store import ExpertStore, StoreConfig
from moestream.store.disk import DiskReader
from moestream.store.factory import open_store
from moestream.store.transfer import TransferError, pieces
from moestream.topology import ExpertKey
from tests.store.links import LateLink
from tests.store.test_store import assert_holds_expert
from tests.store.test_transfer_rules import OrderedGates

K = ExpertKey


def make_async(ckpt, device_slots, chunk_bytes=0, timeout_s=10.0, reader=None):
    eb = ckpt.index.topology.expert_bytes
    config = StoreConfig(device_slots * eb, "0", asynchronous=True, chunk_bytes=chunk_bytes,
                         transfer_timeout_s=timeout_s)
    return open_store(ckpt.index, config, LRUPolicy(), LRUPolicy(), reader=reader)


class GatedReader:
    """Forwards reads to a disk reader, each once the test opens the gate (or with a delay, or failing)."""

    def __init__(self, inner=None, gate=None, delay_s=lambda: 0.0, fail=lambda batch: False):
        self.inner = inner if inner is not None else DiskReader()
        self.gate, self.delay_s, self.fail = gate, delay_s, fail
        self.files = []

    def read_batch(self, batch):
        self.files.append(batch[0][0][0].offset)
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay_s())
        if self.fail(batch):
            raise OSError("injected read failure")
        return self.inner.read_batch(batch)

    def close(self):
        self.inner.close()


class ExpertGates:
    """Forwards each read to the real reader once the test has let through every expert it reads (`open`);
    `reading` holds the experts whose reads have begun."""

    def __init__(self, index, opened=()):
        self.inner, self.opened, self.reading, self.cond = DiskReader(), set(opened), set(), threading.Condition()
        self.owner = {(seg.file, seg.offset): key for key, loc in index.locations.items() for seg in loc.segments}

    def read_batch(self, batch):
        keys = {self.owner[(seg.file, seg.offset)] for segments, _ in batch for seg in segments}
        with self.cond:
            self.reading |= keys
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: keys <= self.opened, 10), f"experts {keys} were never let through"
        return self.inner.read_batch(batch)

    def wait_reading(self, keys):
        with self.cond:
            assert self.cond.wait_for(lambda: set(keys) <= self.reading, 10), f"reading only {self.reading}"

    def open(self, *keys):
        with self.cond:
            self.opened.update(keys)
            self.cond.notify_all()

    def close(self):
        self.inner.close()


def take(store, keys, reorder=True, link=None):
    """(key, a copy of its slot) for each key fetched, in the order handed out; link: one whose copies
    run when compute waits for them (tests/store/links.py), run before each slot is read."""
    fetch = store.fetch(keys)
    try:
        return [(key, _read(slot, link)) for key, slot in fetch.ready(reorder)]
    finally:
        fetch.release()


def _read(slot, link):
    """The slot's bytes as compute reads them: after the copies compute waits for (with a link that has any)."""
    if link is not None:
        link.compute()
    return slot.clone()


@pytest.mark.parametrize("chunk_bytes", [0, 40, 4096])
def test_fetched_experts_hold_their_bytes(checkpoint, chunk_bytes):
    with make_async(checkpoint, device_slots=3, chunk_bytes=chunk_bytes) as store:
        for keys in ([K(0, 0), K(1, 3)], [K(0, 1), K(1, 3), K(0, 2)], [K(1, 0), K(0, 0)]):
            got = take(store, keys)
            assert sorted(k for k, _ in got) == sorted(keys)
            for key, slot in got:
                assert_holds_expert(checkpoint, slot, key)
        assert store.in_flight() == frozenset()


def test_prefetch_returns_before_the_bytes_and_in_flight_tells_the_truth(checkpoint):
    gate = threading.Event()
    with make_async(checkpoint, device_slots=4, reader=GatedReader(gate=gate)) as store:
        brought = store.prefetch([TransferRequest(K(1, 1), 0.9), TransferRequest(K(1, 2), 0.5)])
        assert brought == [K(1, 1), K(1, 2)]
        assert store.in_flight() == {K(1, 1), K(1, 2)} and store.resident() == frozenset()
        gate.set()
        store.wait_idle()
        assert store.in_flight() == frozenset() and store.resident() == {K(1, 1), K(1, 2)}
        got = dict(take(store, [K(1, 2)]))
        assert_holds_expert(checkpoint, got[K(1, 2)], K(1, 2))
        stats = store.stats()
        assert (stats.hits, stats.misses, stats.prefetch_hits) == (1, 0, 1)
        assert stats.transfer_s > 0 and stats.bytes_read["disk"] == 2 * checkpoint.index.topology.expert_bytes


def block_on_a_first_read(store, reader: GatedReader) -> None:
    """Prefetches K(0, 3) at 0.9 through the store's gated reader; returns once the worker blocks on its
    first chunk (until the gate is set)."""
    store.prefetch([TransferRequest(K(0, 3), 0.9)])
    while not reader.files:
        time.sleep(0.001)


def test_a_gate_decision_sends_stale_speculation_of_its_layer_back_and_goes_first(checkpoint):
    gates = OrderedGates(checkpoint.index)
    with make_async(checkpoint, device_slots=7, reader=gates) as store:
        store.prefetch([TransferRequest(K(0, 3), 0.9)])
        gates.wait_reading(K(0, 3))  # under way, held until the gates open
        store.prefetch([TransferRequest(K(1, e), 0.5) for e in range(3)] + [TransferRequest(K(0, 2), 0.1)])
        fetch = store.fetch([K(1, 0), K(1, 3)])  # layer 1 chose experts 0 and 3
        assert store.in_flight() == {K(0, 3), K(0, 2), K(1, 0), K(1, 1), K(1, 2), K(1, 3)}  # all keep their slots
        assert store.stats().cancelled == 0 and store.stats().late == 1
        gates.open(*checkpoint.index.topology.keys())
        order = [key for key, _ in fetch.ready()]
        fetch.release()
        store.wait_idle()
    assert sorted(order) == [K(1, 0), K(1, 3)]
    assert gates.reads[1] == {K(1, 0), K(1, 3)}  # the demand round next, then K(0, 2) before the stale ones
    assert K(0, 2) in gates.reads[2] and set().union(*gates.reads[2:]) == {K(0, 2), K(1, 1), K(1, 2)}
    assert (store.stats().misses, store.stats().hits) == (1, 1)  # K(1, 3) read on demand, K(1, 0) a late hit


def test_a_demand_miss_cancels_queued_speculation_when_every_slot_is_taken(checkpoint):
    gate = threading.Event()
    with make_async(checkpoint, device_slots=3, reader=GatedReader(gate=gate)) as store:
        store.prefetch([TransferRequest(K(0, e), 1.0 - e / 10) for e in range(3)])
        fetch = store.fetch([K(1, 0), K(1, 1)])
        gate.set()
        got = dict(fetch.ready())
        fetch.release()
        for key, slot in got.items():
            assert_holds_expert(checkpoint, slot, key)
        assert store.stats().cancelled >= 1


def test_a_failed_read_surfaces_as_an_error_and_the_store_recovers(checkpoint):
    fail = {"on": True}
    with make_async(checkpoint, device_slots=4, reader=GatedReader(fail=lambda batch: fail["on"])) as store:
        with pytest.raises(TransferError, match=r"expert \(0, 1\).*injected"):
            take(store, [K(0, 1)])
        assert store.resident() == frozenset() and store.in_flight() == frozenset()
        fail["on"] = False
        assert_holds_expert(checkpoint, dict(take(store, [K(0, 1)]))[K(0, 1)], K(0, 1))


def test_every_wait_has_a_timeout(checkpoint):
    gate = threading.Event()
    with make_async(checkpoint, device_slots=4, timeout_s=0.2, reader=GatedReader(gate=gate)) as store:
        with pytest.raises(TransferError, match="timed out"):
            take(store, [K(0, 1)])
        gate.set()


def random_steps(store, checkpoint, rng: random.Random, num_steps: int, link=None) -> int:
    """Random prefetches of one layer and fetches of the other, alternating; each fetched slot holds its
    expert's bytes (link: as take's). Returns how many fetches failed with a TransferError."""
    failures = 0
    for step in range(num_steps):
        layer = step % 2
        store.prefetch([TransferRequest(K(1 - layer, rng.randrange(4)), rng.random()) for _ in range(2)])
        keys = [K(layer, e) for e in rng.sample(range(4), 2)]
        try:
            for key, slot in take(store, keys, link=link):
                assert_holds_expert(checkpoint, slot, key)
        except TransferError:
            failures += 1
    return failures


def settle(store) -> None:
    """Waits until no transfer is in flight."""
    try:
        store.wait_idle()
    except TransferError:
        pass  # the failure of one of them, expected here


def test_random_delays_and_failures_keep_bytes_exact_and_leak_nothing(checkpoint):
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    rng = random.Random(0)
    reader = GatedReader(delay_s=lambda: rng.random() * 0.002, fail=lambda batch: rng.random() < 0.05)
    with make_async(checkpoint, device_slots=4, chunk_bytes=64, reader=reader) as store:
        assert random_steps(store, checkpoint, rng, 60) > 0
        settle(store)
        store.end_plan()  # the last plan's pins
        assert not store.pinned() and store.in_flight() == frozenset()
    assert threading.active_count() == threads
    assert len(os.listdir("/proc/self/fd")) == fds


def test_close_stops_the_worker_and_refuses_later_calls(checkpoint):
    threads = threading.active_count()
    store = make_async(checkpoint, device_slots=4)
    store.prefetch([TransferRequest(K(0, e), 1.0) for e in range(4)])
    store.close()
    assert threading.active_count() == threads and store.in_flight() == frozenset()
    with pytest.raises(TransferError, match="closed"):
        store.fetch([K(0, 0)])


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("chunk_bytes", [0, 40])
def test_staged_transfers_copy_every_chunk_through_the_link(checkpoint, chunk_bytes, late):
    """The CUDA path's staging (read into the one staging slot, copy up through the link), on the CPU.
    late: a link whose copies complete later (tests/store/links.py): the staging slot is reused only once
    the copy from it has run."""
    eb = checkpoint.index.topology.expert_bytes
    config = StoreConfig(3 * eb, "0", asynchronous=True, chunk_bytes=chunk_bytes)
    link = LateLink() if late else None
    with ExpertStore(checkpoint.index, config, LRUPolicy(), LRUPolicy(), link=link, staging=1) as store:
        staging = store.slot_pools()["staging"]
        staging.data.zero_()
        store.prefetch([TransferRequest(K(1, 2), 1.0)])
        for keys in ([K(0, 0), K(1, 3)], [K(1, 2), K(0, 1)]):
            for key, slot in take(store, keys, link=link):
                assert_holds_expert(checkpoint, slot, key)
        assert staging.data.any()  # the bytes came through the staging slot


def test_fetching_one_group_keeps_the_speculation_for_the_layers_other_chosen_experts(checkpoint):
    gate = threading.Event()
    with make_async(checkpoint, device_slots=6, reader=(reader := GatedReader(gate=gate))) as store:
        block_on_a_first_read(store, reader)
        store.prefetch([TransferRequest(K(1, 1), 0.5), TransferRequest(K(1, 2), 0.4)])
        fetch = store.fetch([K(1, 0)], chosen=[K(1, 0), K(1, 1)])
        assert store.in_flight() == {K(0, 3), K(1, 0), K(1, 1), K(1, 2)}  # K(1, 2) sent back, K(1, 1) not
        assert store.stats().cancelled == 0
        gate.set()
        list(fetch.ready())
        fetch.release()
        store.wait_idle()


def resident_and_in_flight(store, gates: ExpertGates, in_flight=(K(0, 2),)) -> None:
    """K(0, 0) resident; in_flight prefetched in that order, their reads begun and held until let through
    (the store reads through gates, which let K(0, 0) through)."""
    take(store, [K(0, 0)])
    store.prefetch([TransferRequest(key, 0.9 - i / 10) for i, key in enumerate(in_flight)])
    gates.wait_reading(in_flight)


def test_reordering_hands_out_the_resident_expert_then_the_one_in_flight_as_it_lands_then_the_miss(checkpoint):
    gates = ExpertGates(checkpoint.index, opened=[K(0, 0)])
    with make_async(checkpoint, device_slots=4, timeout_s=5.0, reader=gates) as store:
        resident_and_in_flight(store, gates)
        fetch = store.fetch([K(0, 3), K(0, 2), K(0, 0)])  # a miss, one in flight, one resident
        ready = fetch.ready(reorder=True)
        assert next(ready)[0] == K(0, 0)  # while no read can finish
        gates.open(K(0, 2))
        assert next(ready)[0] == K(0, 2)  # the miss's read is still held
        gates.open(K(0, 3))
        assert [key for key, _ in ready] == [K(0, 3)]
        fetch.release()


def test_without_reordering_experts_are_handed_out_in_the_order_asked(checkpoint):
    gates = ExpertGates(checkpoint.index, opened=[K(0, 0)])
    with make_async(checkpoint, device_slots=4, timeout_s=5.0, reader=gates) as store:
        resident_and_in_flight(store, gates)
        fetch = store.fetch([K(0, 3), K(0, 2), K(0, 0)])
        order = []
        consumer = threading.Thread(target=lambda: order.extend(key for key, _ in fetch.ready(reorder=False)))
        consumer.start()
        gates.open(K(0, 2))
        deadline = time.time() + 10
        while K(0, 2) not in store.resident():
            assert time.time() < deadline, "K(0, 2) never landed"
            time.sleep(0.001)
        gates.open(K(0, 3))
        consumer.join(10)
        fetch.release()
    assert order == [K(0, 3), K(0, 2), K(0, 0)]  # K(0, 0) was in place and K(0, 2) landed first


class RoundLog(DiskReader):
    """The disk reader, recording how many chunks each read batch (one worker round) holds (its segments)."""

    def __init__(self):
        super().__init__()
        self.rounds = []

    def read_batch(self, batch):
        self.rounds.append(sum(len(segments) for segments, _ in batch))
        return super().read_batch(batch)


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_disk_round_reads_as_many_speculative_chunks_as_configured(checkpoint, chunks):
    eb = checkpoint.index.topology.expert_bytes
    config = StoreConfig(4 * eb, "0", asynchronous=True, chunks_in_flight=chunks, chunk_bytes=32)
    reader = RoundLog()
    with open_store(checkpoint.index, config, LRUPolicy(), LRUPolicy(), reader=reader) as store:
        store.prefetch([TransferRequest(K(0, e), 1.0 - e / 10) for e in range(3)])  # many 32-byte chunks each
        store.wait_idle()
        pieces_of = [len(pieces(checkpoint.index.locations[K(0, e)].segments, 32)) for e in range(3)]
        assert max(reader.rounds) == chunks < min(pieces_of) and sum(reader.rounds) == sum(pieces_of)
