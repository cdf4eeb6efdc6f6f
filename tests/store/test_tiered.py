"""The two-tier asynchronous store on the CPU link: the same code as the CUDA path (pinned host slots,
copy stream and events behind `Link`), with the disk -> host and host -> device workers at once."""

import os
import random
import threading
import time

import pytest
import torch

from moestream.contracts import TransferRequest
from moestream.errors import CheckpointError
from moestream.policies.eviction import LRUPolicy
from moestream.store import ExpertStore, StoreConfig
from moestream.store.streams import CpuLink
from moestream.store.transfer import TransferError
from moestream.topology import ExpertKey
from tests.store.checks import RecordingIntegrity
from tests.store.links import LateLink
from tests.store.test_async_store import GatedReader, random_steps, settle, take
from tests.store.test_store import assert_holds_expert

K = ExpertKey


def make_tiered(ckpt, device_slots, host_slots, chunk_bytes=0, timeout_s=10.0, reader=None, link=None):
    eb = ckpt.index.topology.expert_bytes
    config = StoreConfig(device_slots * eb, host_slots * eb, asynchronous=True, chunk_bytes=chunk_bytes,
                         transfer_timeout_s=timeout_s)
    return ExpertStore(ckpt.index, config, LRUPolicy(), LRUPolicy(), reader=reader, link=link)


class SlowReader(GatedReader):
    """GatedReader that tells whether a read is under way."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reading = threading.Event()

    def read_batch(self, batch):
        self.reading.set()
        try:
            return super().read_batch(batch)
        finally:
            self.reading.clear()


class GatedLink:
    """Forwards copies to a link (the CPU's) once the gate opens; records whether a disk read was under way."""

    def __init__(self, inner=None, gate=None, reader=None, delay_s=lambda: 0.0, fail=lambda: False):
        self.inner = inner if inner is not None else CpuLink(torch.device("cpu"))
        self.gate, self.reader, self.delay_s, self.fail = gate, reader, delay_s, fail
        self.copying = threading.Event()
        self.during_read = []

    def copy(self, dst, src, after=None):
        self.copying.set()
        if self.reader is not None:
            self.during_read.append(self.reader.reading.is_set())
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay_s())
        if self.fail():
            raise RuntimeError("injected copy failure")
        return self.inner.copy(dst, src, after)

    def compute_event(self):
        return self.inner.compute_event()

    def compute(self):
        """The compute stream's next work begins (see LateLink; the CPU link's copies have run)."""
        if hasattr(self.inner, "compute"):
            self.inner.compute()

    def synchronize(self):
        self.inner.synchronize()


def evict_to_host(store, *keys):
    """Fetches keys, then enough others that the device tier (2 slots) no longer holds them."""
    take(store, list(keys))
    take(store, [K(1, 2), K(1, 3)])


def wait_for(event_or_test, timeout_s=5.0):
    deadline = time.time() + timeout_s
    test = event_or_test.is_set if hasattr(event_or_test, "is_set") else event_or_test
    while not test():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.001)


@pytest.mark.parametrize("chunk_bytes", [0, 40])
def test_experts_go_disk_to_host_to_device_and_the_host_tier_keeps_them(checkpoint, chunk_bytes):
    eb = checkpoint.index.topology.expert_bytes
    with make_tiered(checkpoint, device_slots=2, host_slots=6, chunk_bytes=chunk_bytes) as store:
        for keys in ([K(0, 0), K(1, 3)], [K(0, 1), K(0, 2)], [K(1, 0), K(0, 0)]):
            for key, slot in take(store, keys):
                assert_holds_expert(checkpoint, slot, key)
        stats = store.stats()
        assert store.resident("host") == {K(0, 0), K(1, 3), K(0, 1), K(0, 2), K(1, 0)}
        assert (stats.host_misses, stats.host_hits) == (5, 1)  # K(0, 0) came back from the host tier
        assert stats.bytes_read == {"disk": 5 * eb, "host": 6 * eb}
        assert stats.copy_s > 0 and stats.transfer_s > 0
        assert store.in_flight() == frozenset() and not store.pinned("host")


def test_both_links_run_at_once(checkpoint):
    gate = threading.Event()
    gate.set()  # open until K(0, 0) is in the host tier alone
    reader = SlowReader(gate=gate)
    link = GatedLink(reader=reader)
    with make_tiered(checkpoint, device_slots=2, host_slots=6, reader=reader, link=link) as store:
        evict_to_host(store, K(0, 0))
        gate.clear()
        link.during_read.clear()
        store.prefetch([TransferRequest(K(0, 1), 0.5)])  # a host miss: the disk worker blocks on it
        wait_for(reader.reading)
        got = dict(take(store, [K(0, 0)]))  # a host hit: copied up while the disk read goes on
        assert_holds_expert(checkpoint, got[K(0, 0)], K(0, 0))
        assert set(link.during_read) == {True} and store.in_flight() == {K(0, 1)}  # each chunk of the copy
        assert K(0, 1) in store.pinned("host") and K(0, 1) not in store.resident("host")  # its slot is being written
        gate.set()
        store.wait_idle()
        assert store.resident() == {K(0, 0), K(0, 1)} and K(0, 1) in store.resident("host")
        assert_holds_expert(checkpoint, dict(take(store, [K(0, 1)]))[K(0, 1)], K(0, 1))


class HeldCopies:
    """Holds the store's copies up: `late`, issued on a link whose copies run only when allowed
    (tests/store/links.py); else each copy blocks before it is issued, until the gate opens."""

    def __init__(self, late: bool):
        self.late, self.gate = late, threading.Event()
        self.link = LateLink(credits=0) if late else GatedLink(gate=self.gate)

    def wait_copying(self):
        wait_for((lambda: self.link.issued) if self.late else self.link.copying)

    def let_go(self):
        if self.late:
            self.link.allow(1000)
        else:
            self.gate.set()


def test_a_host_slot_being_copied_up_is_pinned_until_its_copy_is_issued(checkpoint):
    copies, reader = HeldCopies(late=False), GatedReader()
    with make_tiered(checkpoint, device_slots=4, host_slots=1, reader=reader, link=copies.link) as store:
        first = store.fetch([K(0, 0)])
        copies.wait_copying()  # K(0, 0) is in the one host slot, its copy up is held
        assert store.prefetch([TransferRequest(K(0, 1), 1.0)]) == []  # speculation finds no host slot
        done = {}
        second = threading.Thread(target=lambda: done.update(take(store, [K(0, 2)])))
        second.start()
        time.sleep(0.05)
        assert len(reader.files) == 1 and not done  # the demand waits for the slot, nothing overwrote it
        copies.let_go()
        second.join(10)
        assert_holds_expert(checkpoint, dict(first.ready())[K(0, 0)], K(0, 0))
        first.release()
        assert_holds_expert(checkpoint, done[K(0, 2)], K(0, 2))
        assert store.resident("host") == {K(0, 2)} and store.resident() == {K(0, 0), K(0, 2)}


def test_a_host_slot_is_read_into_again_only_once_the_copy_up_from_it_has_run(checkpoint):
    """Copies issued but not yet run (tests/store/links.py): the expert lands when its copy is issued and
    its host slot is free again, but a read into that slot waits for the copy."""
    copies, reader = HeldCopies(late=True), GatedReader()
    with make_tiered(checkpoint, device_slots=4, host_slots=1, reader=reader, link=copies.link) as store:
        first = store.fetch([K(0, 0)])
        got = dict(first.ready())  # handed out before its copy has run: compute waits for it
        assert copies.link.issued and not copies.link.ran
        assert store.prefetch([TransferRequest(K(0, 1), 1.0)]) == [K(0, 1)]  # takes the one host slot
        time.sleep(0.05)
        assert len(reader.files) == 1 and store.in_flight() == {K(0, 1)}  # its read waits for the copy
        copies.let_go()
        store.wait_idle()
        assert len(reader.files) == 2 and store.resident("host") == {K(0, 1)}
        copies.link.compute()
        assert_holds_expert(checkpoint, got[K(0, 0)], K(0, 0))
        first.release()
        assert_holds_expert(checkpoint, dict(take(store, [K(0, 1)], link=copies.link))[K(0, 1)], K(0, 1))


def test_a_gate_decision_sends_queued_copies_of_its_layer_back_and_they_keep_their_slots(make_checkpoint):
    ckpt, gate = make_checkpoint(num_experts=8), threading.Event()
    gate.set()  # open until the copies below
    link = GatedLink(gate=gate)
    with make_tiered(ckpt, device_slots=4, host_slots=8, link=link) as store:
        for keys in ([K(1, 1), K(1, 2)], [K(0, 0), K(0, 1)], [K(0, 2), K(0, 3)]):
            take(store, keys)  # the device tier no longer holds K(1, 1), K(1, 2); the host tier does
        gate.clear()
        link.copying.clear()
        store.prefetch([TransferRequest(K(0, 4), 0.9)])  # read, then its copy up waits on the gate
        wait_for(link.copying)
        store.prefetch([TransferRequest(K(1, 1), 0.5), TransferRequest(K(1, 2), 0.4)])  # queued copies
        assert store.in_flight() == {K(0, 4), K(1, 1), K(1, 2)}
        fetch = store.fetch([K(1, 3)])
        assert store.stats().cancelled == 0 and store.in_flight() == {K(0, 4), K(1, 1), K(1, 2), K(1, 3)}
        assert {K(1, 1), K(1, 2)} <= store.resident("host")
        gate.set()
        got = dict(fetch.ready())
        fetch.release()
        assert_holds_expert(ckpt, got[K(1, 3)], K(1, 3))
        store.wait_idle()
        assert store.resident() == {K(0, 4), K(1, 1), K(1, 2), K(1, 3)}
        assert not store.pinned("host")


def test_a_failed_read_and_a_failed_copy_surface_as_errors_and_the_store_recovers(checkpoint):
    fail = {"read": True, "copy": False}
    reader, link = GatedReader(fail=lambda batch: fail["read"]), GatedLink(fail=lambda: fail["copy"])
    with make_tiered(checkpoint, device_slots=2, host_slots=4, reader=reader, link=link) as store:
        with pytest.raises(TransferError, match=r"reading expert \(0, 1\) from disk.*injected"):
            take(store, [K(0, 1)])
        assert store.resident("host") == frozenset() and store.in_flight() == frozenset()
        fail.update(read=False, copy=True)
        with pytest.raises(TransferError, match=r"copying expert \(0, 1\) from host to device.*injected"):
            take(store, [K(0, 1)])
        assert store.resident("host") == {K(0, 1)} and store.resident() == frozenset()
        fail["copy"] = False
        assert_holds_expert(checkpoint, dict(take(store, [K(0, 1)]))[K(0, 1)], K(0, 1))
        stats = store.stats()
        assert (stats.host_misses, stats.host_hits) == (1, 1) and not store.pinned("host")


def test_a_damaged_expert_fails_in_its_host_slot_before_any_copy_up(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    config = StoreConfig(2 * eb, 4 * eb, asynchronous=True)
    integrity = RecordingIntegrity(eb, damaged=(K(1, 2),))
    with ExpertStore(checkpoint.index, config, LRUPolicy(), LRUPolicy(), integrity) as store:
        with pytest.raises(CheckpointError, match=r"\(1, 2\) is damaged"):
            take(store, [K(1, 1), K(1, 2)])
        store.wait_idle()
        assert store.resident("host") == {K(1, 1)} and store.resident() == {K(1, 1)}
        assert store.stats().bytes_read == {"disk": eb, "host": eb}  # K(1, 2) failed in its read, never copied up
        assert sorted(integrity.checked) == [K(1, 1), K(1, 2)] and not store.pinned("host")


def test_a_stuck_copy_times_out(checkpoint):
    gate = threading.Event()
    with make_tiered(checkpoint, device_slots=2, host_slots=2, timeout_s=0.2, link=GatedLink(gate=gate)) as store:
        with pytest.raises(TransferError, match="timed out"):
            take(store, [K(0, 1)])
        gate.set()


@pytest.mark.parametrize("late", [False, True])
def test_random_delays_and_failures_in_both_links_keep_bytes_exact_and_leak_nothing(checkpoint, late):
    """late: the copies complete later, when the copy link waits for them (tests/store/links.py)."""
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    rng = random.Random(0)
    reader = GatedReader(delay_s=lambda: rng.random() * 0.002, fail=lambda batch: rng.random() < 0.04)
    link = GatedLink(LateLink() if late else None, delay_s=lambda: rng.random() * 0.001,
                     fail=lambda: rng.random() < 0.04)
    with make_tiered(checkpoint, device_slots=3, host_slots=2, chunk_bytes=64, reader=reader, link=link) as store:
        assert random_steps(store, checkpoint, rng, 80, link=link) > 0
        settle(store)
        store.end_plan()  # the last plan's pins
        assert not store.pinned("host") and not store.pinned()
        assert store.in_flight() == frozenset()
    assert threading.active_count() == threads
    assert len(os.listdir("/proc/self/fd")) == fds


def test_close_stops_both_workers_and_refuses_later_calls(checkpoint):
    threads = threading.active_count()
    store = make_tiered(checkpoint, device_slots=4, host_slots=2)
    assert threading.active_count() == threads + 2
    store.prefetch([TransferRequest(K(0, e), 1.0) for e in range(4)])
    store.close()
    assert threading.active_count() == threads and store.in_flight() == frozenset()
    assert not store.pinned("host")
    with pytest.raises(TransferError, match="closed"):
        store.fetch([K(0, 0)])


def test_without_a_host_tier_the_store_runs_one_link_from_disk_to_device(checkpoint):
    threads = threading.active_count()
    with make_tiered(checkpoint, device_slots=2, host_slots=0) as store:
        assert threading.active_count() == threads + 1
        for key, slot in take(store, [K(0, 0), K(1, 1)]):
            assert_holds_expert(checkpoint, slot, key)
        assert store.resident("host") == frozenset() and store.stats().host_hits == 0
