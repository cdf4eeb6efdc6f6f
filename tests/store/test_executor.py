"""Where the store's transfers run (inline on the caller's thread, or threaded), and the times it
derives from the tracer it is given."""

import threading

import pytest

from moestream.contracts import TransferRequest
from moestream.policies.eviction import LRUPolicy
from moestream.store import ExpertStore, InlineExecutor, StoreConfig, ThreadedExecutor
from moestream.topology import ExpertKey
from moestream.tracer import LaneTotal, Tracer
from tests.store.test_store import assert_holds_expert

K = ExpertKey


def make(ckpt, asynchronous, tracer, device_slots=2, host_slots=2):
    eb = ckpt.index.topology.expert_bytes
    config = StoreConfig(device_slots * eb, host_slots * eb, asynchronous=asynchronous)
    return ExpertStore(ckpt.index, config, LRUPolicy(), LRUPolicy(), tracer=tracer)


def test_the_inline_executor_moves_every_byte_on_the_callers_thread_before_the_call_returns(checkpoint):
    threads, tracer = threading.active_count(), Tracer()
    with make(checkpoint, False, tracer, device_slots=3, host_slots=1) as store:
        assert isinstance(store.executor, InlineExecutor) and threading.active_count() == threads
        assert store.prefetch([TransferRequest(K(1, e), 1.0 - e / 10) for e in range(2)]) == [K(1, 0), K(1, 1)]
        assert store.in_flight() == frozenset() and store.resident() == {K(1, 0), K(1, 1)}  # one host slot: in turn
        slots = store.acquire([K(0, 0), K(0, 1)])
        assert store.in_flight() == frozenset()
        for key, slot in slots.items():
            assert_holds_expert(checkpoint, slot, key)
        store.release(list(slots))
    lanes = tracer.totals()
    assert lanes["disk"].spans == 4 and lanes["h2d"].spans == 4  # each expert waited for its host slot
    assert lanes["wait"].spans == 4  # each call: the caller waited for the host slot, then for the rest


@pytest.mark.parametrize("asynchronous", [False, True])
def test_times_come_from_the_tracers_lanes_since_the_last_reset(checkpoint, asynchronous):
    tracer = Tracer()
    with make(checkpoint, asynchronous, tracer, host_slots=0) as store:
        store.release(store.acquire([K(0, 0), K(0, 1)]))
        store.wait_idle()
        lanes, stats = tracer.totals(), store.stats()
        assert (stats.transfer_s, stats.disk_read_s, stats.disk_batches) == (
            lanes["disk"].seconds, lanes["disk"].seconds, lanes["disk"].spans)
        assert stats.copy_s == 0 and "h2d" not in lanes  # one tier: one link
        assert stats.read_fit.batches == lanes["disk"].spans and stats.read_fit.experts == 2
        stall = lanes.get("wait", LaneTotal()).seconds if asynchronous else lanes["disk"].seconds  # inline: its rounds
        assert stats.stall_s == stall and stats.disk_batches > 0
        store.reset_stats()
        assert (store.stats().stall_s, store.stats().transfer_s, store.stats().disk_batches) == (0, 0, 0)
        assert tracer.totals() == lanes  # the tracer keeps its totals: the store counts from a copy
        store.release(store.acquire([K(1, 0)]))
        store.wait_idle()
        assert store.stats().disk_batches == store.stats().read_fit.batches == 1 and store.stats().transfer_s > 0


def test_the_threaded_executor_runs_a_worker_per_link_and_its_caller_stalls_only_in_waits(checkpoint):
    threads, tracer = threading.active_count(), Tracer()
    eb = checkpoint.index.topology.expert_bytes
    config = StoreConfig(2 * eb, 2 * eb, asynchronous=True)  # tiers kept apart, as on CUDA
    with ExpertStore(checkpoint.index, config, LRUPolicy(), LRUPolicy(), tracer=tracer) as store:
        assert isinstance(store.executor, ThreadedExecutor) and threading.active_count() == threads + 2
        for key, slot in store.acquire([K(0, 0), K(1, 1)]).items():
            assert_holds_expert(checkpoint, slot, key)
        stats = store.stats()
        assert stats.stall_s == tracer.totals()["wait"].seconds > 0
        assert stats.copy_s == tracer.totals()["h2d"].seconds > 0
    assert threading.active_count() == threads
