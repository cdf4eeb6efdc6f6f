import numpy as np
import pytest
import torch

from moestream.cache import CacheFullError
from moestream.checkpoint.layout import ExpertIndex, ExpertLocation
from moestream.contracts import TransferRequest
from moestream.errors import BudgetError, CheckpointError
from moestream.policies.eviction import LRUPolicy
from moestream.store import ExpertStore, StoreConfig
from moestream.store.disk import DiskReader
from moestream.topology import ExpertKey
from tests.store.checks import RecordingIntegrity
from tests.store.links import LateLink

K = ExpertKey


def make_store(ckpt, device_slots, host_slots=0, device="cpu", direct_io=True, reader=None):
    expert_bytes = ckpt.index.topology.expert_bytes
    config = StoreConfig(device_slots * expert_bytes, host_slots * expert_bytes, device, direct_io)
    return ExpertStore(ckpt.index, config, LRUPolicy(), LRUPolicy(), reader=reader)


def use(store, *keys):
    slots = store.acquire(keys)
    store.release(keys)
    return slots


def assert_holds_expert(ckpt, slot, key):
    views = ckpt.index.views(slot)
    for name, tensor in ckpt.expected(key).items():
        assert views[name].dtype == tensor.dtype
        assert torch.equal(views[name].cpu(), tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("host_slots", [0, 3])
def test_acquired_slots_view_as_the_original_tensors(make_checkpoint, dtype, host_slots):
    ckpt = make_checkpoint(dtype=dtype)
    with make_store(ckpt, device_slots=3, host_slots=host_slots) as store:
        for keys in ([K(0, 0), K(1, 3)], [K(0, 1), K(1, 3), K(0, 2)], [K(1, 0), K(0, 0)]):
            slots = store.acquire(keys)
            assert list(slots) == keys
            for key, slot in slots.items():
                assert slot.dtype == torch.uint8 and slot.shape == (ckpt.index.topology.expert_bytes,)
                assert_holds_expert(ckpt, slot, key)
            store.release(keys)


def test_hits_misses_and_bytes_are_counted(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    with make_store(checkpoint, device_slots=4, host_slots=4) as store:
        use(store, K(0, 0), K(0, 1))
        stats = store.stats()
        assert (stats.hits, stats.misses, stats.host_hits, stats.host_misses) == (0, 2, 0, 2)
        assert stats.bytes_read == {"disk": 2 * eb, "host": 2 * eb}
        use(store, K(0, 1), K(0, 0), K(1, 1))
        stats = store.stats()
        assert (stats.hits, stats.misses) == (2, 3)
        assert stats.bytes_read == {"disk": 3 * eb, "host": 3 * eb}
        assert stats.disk_read_s > 0 and stats.hit_rate == pytest.approx(2 / 5)
        store.reset_stats()
        assert store.stats().misses == 0 and store.stats().bytes_read == {"disk": 0, "host": 0}


def test_no_host_tier_reads_disk_straight_into_the_device_slot(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    with make_store(checkpoint, device_slots=2) as store:
        assert store.host_slots == 0 and store.resident("host") == frozenset()
        use(store, K(0, 0), K(1, 0))
        assert store.stats().bytes_read == {"disk": 2 * eb, "host": 0}


def test_lru_victims_in_order(checkpoint):
    with make_store(checkpoint, device_slots=3) as store:
        use(store, K(0, 0))
        use(store, K(0, 1))
        use(store, K(0, 2))
        use(store, K(0, 0))
        use(store, K(0, 3))
        assert store.resident() == {K(0, 0), K(0, 2), K(0, 3)}
        use(store, K(1, 0))
        assert store.resident() == {K(0, 0), K(0, 3), K(1, 0)}
        assert store.stats().evictions == {"device": 2, "host": 0}


def test_pinned_experts_are_never_evicted(checkpoint):
    with make_store(checkpoint, device_slots=3) as store:
        held = store.acquire([K(0, 0)])[K(0, 0)]
        for expert in range(1, 4):
            for layer in range(2):
                use(store, K(layer, expert))
                assert K(0, 0) in store.resident()
        assert_holds_expert(checkpoint, held, K(0, 0))
        store.release([K(0, 0)])
        use(store, K(1, 0), K(1, 1), K(1, 2))
        assert K(0, 0) not in store.resident()


def test_keys_may_be_numpy_pairs(checkpoint):
    with make_store(checkpoint, device_slots=2) as store:
        slots = store.acquire([(np.int64(1), np.int64(2))])
        assert list(slots) == [K(1, 2)] and type(next(iter(slots)).layer) is int
        store.release([K(1, 2)])
        assert not store.pinned()


def test_pins_count_per_acquire(checkpoint):
    with make_store(checkpoint, device_slots=2) as store:
        store.acquire([K(0, 0)])
        store.acquire([K(0, 0)])
        store.release([K(0, 0)])
        use(store, K(0, 1))
        use(store, K(0, 2))
        assert K(0, 0) in store.resident()


def test_more_keys_than_the_device_holds_is_refused_without_side_effects(checkpoint):
    with make_store(checkpoint, device_slots=3) as store:
        with pytest.raises(CacheFullError, match="streaming_groups"):
            store.acquire([K(0, e) for e in range(4)])
        store.acquire([K(0, 0), K(0, 1)])
        with pytest.raises(CacheFullError):
            store.acquire([K(1, 0), K(1, 1)])
        assert store.stats().misses == 2
        store.release([K(0, 0), K(0, 1)])
        use(store, K(1, 0), K(1, 1), K(1, 2))  # the failed calls left no pins behind


def test_device_miss_that_hits_host_reads_no_disk(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    with make_store(checkpoint, device_slots=2, host_slots=4) as store:
        use(store, K(0, 0), K(0, 1))
        use(store, K(0, 2), K(0, 3))
        assert K(0, 0) not in store.resident() and K(0, 0) in store.resident("host")
        store.reset_stats()
        slots = store.acquire([K(0, 0)])
        stats = store.stats()
        assert (stats.misses, stats.host_hits, stats.host_misses) == (1, 1, 0)
        assert stats.bytes_read == {"disk": 0, "host": eb}
        assert_holds_expert(checkpoint, slots[K(0, 0)], K(0, 0))


def test_host_tier_evicts_by_its_own_policy(checkpoint):
    with make_store(checkpoint, device_slots=2, host_slots=3) as store:
        for expert in range(4):
            use(store, K(1, expert))
        assert store.resident("host") == {K(1, 1), K(1, 2), K(1, 3)}
        assert store.stats().evictions == {"device": 2, "host": 1}


def test_prefetch_fills_in_priority_order_and_skips_resident(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    with make_store(checkpoint, device_slots=3) as store:
        use(store, K(0, 0))
        requests = [TransferRequest(K(1, 1), 0.2), TransferRequest(K(0, 0), 0.9),
                    TransferRequest(K(1, 2), 0.7), TransferRequest(K(1, 3), 0.5)]
        store.reset_stats()
        assert store.prefetch(requests) == [K(1, 2), K(1, 3)]
        assert store.resident() == {K(1, 2), K(1, 3), K(0, 0)}  # the prefetch kept its own experts
        stats = store.stats()
        assert (stats.prefetched, stats.prefetched_bytes, stats.misses) == (2, 2 * eb, 0)
        assert stats.bytes_read["disk"] == 2 * eb
        use(store, K(1, 2))
        assert store.stats().prefetch_hits == 1 and store.stats().hits == 1
        use(store, K(0, 1), K(0, 2))  # evicts K(0, 0), then K(1, 3), never used
        assert store.stats().prefetch_wasted == 1 and K(1, 3) not in store.resident()
        assert store.in_flight() == frozenset()


def test_prefetch_never_evicts_pinned_experts(checkpoint):
    with make_store(checkpoint, device_slots=3) as store:
        store.acquire([K(0, 0), K(0, 1)])
        brought = store.prefetch([TransferRequest(K(1, e), 1.0 - e / 10) for e in range(4)])
        assert brought == [K(1, 0)]
        assert store.resident() == {K(0, 0), K(0, 1), K(1, 0)}


def test_streaming_groups_cover_all_keys_resident_first(checkpoint):
    with make_store(checkpoint, device_slots=3) as store:
        use(store, K(0, 2), K(1, 3))
        keys = [K(0, 0), K(0, 1), K(0, 2), K(0, 3), K(1, 0), K(1, 3), K(0, 0)]
        groups = store.streaming_groups(keys)
        flat = [key for group in groups for key in group]
        assert sorted(flat) == sorted(set(keys))
        assert all(1 <= len(group) <= store.device_slots for group in groups)
        assert set(flat[:2]) == {K(0, 2), K(1, 3)}
        for group in groups:
            assert_holds_expert(checkpoint, store.acquire(group)[group[-1]], group[-1])
            store.release(group)


def test_streaming_groups_leave_room_for_experts_in_use(checkpoint):
    with make_store(checkpoint, device_slots=3) as store:
        store.acquire([K(1, 1)])
        groups = store.streaming_groups([K(0, e) for e in range(4)])
        assert [len(g) for g in groups] == [2, 2]
        assert store.streaming_groups([]) == []


class CountingReader:
    """Wraps the store's disk reader, recording the destinations of each batch."""

    def __init__(self):
        self.reader = DiskReader()
        self.batches = []

    def read_batch(self, batch):
        self.batches.append(len(batch))
        return self.reader.read_batch(batch)

    def __getattr__(self, name):
        return getattr(self.reader, name)


@pytest.mark.parametrize("host_slots", [0, 2, 8])
def test_the_misses_of_one_call_are_read_as_batches(make_checkpoint, host_slots):
    ckpt = make_checkpoint(num_experts=6)
    reader = CountingReader()
    with make_store(ckpt, device_slots=6, host_slots=host_slots, reader=reader) as store:
        use(store, K(0, 0))
        slots = use(store, *[K(0, e) for e in range(5)])
        for key, slot in slots.items():
            assert_holds_expert(ckpt, slot, key)
        assert store.prefetch([TransferRequest(K(1, e), 1.0) for e in range(3)]) == [K(1, e) for e in range(3)]
        expected = [1, 4, 3] if host_slots != 2 else [1, 2, 2, 2, 1]  # a batch never outgrows the host tier
        assert reader.batches == expected
        assert store.stats().disk_batches == len(expected)
        fit = store.stats().read_fit  # the sums of a line fit over the same batches
        assert (fit.batches, fit.experts) == (len(expected), sum(expected))
        assert fit.experts_sq == sum(n * n for n in expected)
        assert 0 < fit.seconds <= store.stats().disk_read_s + 1e-9
        assert store.stats().bytes_read["disk"] == 8 * ckpt.index.topology.expert_bytes
        if host_slots:
            assert len(store.resident("host")) == min(host_slots, 8)


def test_fallback_reads_serve_the_same_bytes(checkpoint):
    with make_store(checkpoint, device_slots=2, host_slots=2, direct_io=False) as store:
        assert_holds_expert(checkpoint, use(store, K(1, 2))[K(1, 2)], K(1, 2))


def test_store_refuses_a_too_small_budget_and_a_bad_index(checkpoint):
    index = checkpoint.index
    with pytest.raises(BudgetError, match="minimum"):
        make_store(checkpoint, device_slots=index.topology.top_k - 1)
    missing = ExpertIndex(index.topology, {k: v for k, v in index.locations.items() if k != K(1, 1)}, index.layout)
    with pytest.raises(CheckpointError, match="no location"):
        ExpertStore(missing, StoreConfig("1.0", "0"), LRUPolicy(), LRUPolicy())
    short = dict(index.locations)
    short[K(0, 0)] = ExpertLocation(K(0, 0), index.locations[K(0, 0)].segments[:2])
    with pytest.raises(CheckpointError, match="bytes on disk"):
        ExpertStore(ExpertIndex(index.topology, short, index.layout), StoreConfig("1.0", "0"), LRUPolicy(), LRUPolicy())


def test_unknown_tier_is_refused(checkpoint):
    with make_store(checkpoint, device_slots=2) as store, pytest.raises(ValueError, match="tier"):
        store.resident("disk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("host_slots", [0, 2])
def test_cuda_store_uses_pinned_host_slots_and_device_slots(checkpoint, host_slots):
    with make_store(checkpoint, device_slots=2, host_slots=host_slots, device="cuda") as store:
        for keys in ([K(0, 0), K(0, 1)], [K(0, 2), K(1, 0)], [K(0, 0), K(1, 1)]):
            slots = store.acquire(keys)
            for key, slot in slots.items():
                assert slot.is_cuda
                assert_holds_expert(checkpoint, slot, key)
            store.release(keys)
        pools = store.slot_pools()
        assert ("host" not in pools or pools["host"].pinned) and (pools["staging"].num_slots == 0) == (host_slots > 0)
        assert pools["device"].data.is_cuda and ("host" not in pools) == (host_slots == 0)


@pytest.mark.parametrize("host_slots", [0, 2])
def test_a_failed_read_leaves_no_trace(checkpoint, host_slots):
    last = max(checkpoint.index.locations.values(), key=lambda loc: loc.segments[-1].offset)
    end = last.segments[-1]
    with make_store(checkpoint, device_slots=2, host_slots=host_slots) as store:
        use(store, K(0, 0))
        with open(end.file, "r+b") as f:
            f.truncate(end.offset + end.nbytes - 1)
        with pytest.raises(CheckpointError, match="ends at byte"):
            store.acquire([K(0, 0), last.key])
        assert last.key not in store.resident() and last.key not in store.resident("host")
        use(store, K(1, 0), K(0, 1))  # no pins were left behind


@pytest.mark.parametrize("host_slots", [0, 3])
def test_an_expert_that_fails_its_check_is_never_kept(checkpoint, host_slots):
    eb = checkpoint.index.topology.expert_bytes
    config = StoreConfig(3 * eb, host_slots * eb, "cpu", True)
    integrity = RecordingIntegrity(eb, damaged=(K(1, 2),))
    with ExpertStore(checkpoint.index, config, LRUPolicy(), LRUPolicy(), integrity) as store:
        use(store, K(0, 0))
        with pytest.raises(CheckpointError, match="damaged"):
            store.acquire([K(0, 1), K(1, 2)])
        with pytest.raises(CheckpointError, match="damaged"):
            store.prefetch([TransferRequest(K(1, 2), 1.0)])
        assert K(1, 2) not in store.resident("device") | store.resident("host") | store.in_flight()
        assert K(0, 0) in store.resident("device") and integrity.checked[0] == K(0, 0)
        assert_holds_expert(checkpoint, use(store, K(1, 1))[K(1, 1)], K(1, 1))


@pytest.mark.parametrize("asynchronous,host_slots", [(False, 0), (False, 3), (True, 0), (True, 3)])
def test_reads_land_in_place_in_slots_placed_by_file_offset(make_checkpoint, asynchronous, host_slots):
    """Experts of whole 4096-byte parts (layers at different offsets modulo the block): the store
    places each slot congruent to its expert's bytes, so their whole blocks skip the staging copy."""
    ckpt = make_checkpoint(num_layers=4, hidden=64, inter=128, dtype=torch.float32)  # parts of 32 KiB
    residues = {ckpt.index.residue(key, 4096) for key in ckpt.index.locations}
    assert len(residues) > 1 and 0 not in residues
    eb = ckpt.index.topology.expert_bytes
    config = StoreConfig(4 * eb, host_slots * eb, asynchronous=asynchronous)
    disk = DiskReader()
    with ExpertStore(ckpt.index, config, LRUPolicy(), LRUPolicy(), reader=disk) as store:
        for key in ckpt.index.locations:
            slot = store.acquire([key])[key]
            assert_holds_expert(ckpt, slot, key)
            store.release([key])
        if disk.is_direct(ckpt.files[0]):
            assert disk.stats.direct_bytes >= 0.8 * disk.stats.bytes_read


@pytest.mark.parametrize("host_slots", [0, 2])
def test_copies_that_complete_later_are_waited_for_before_compute_and_before_their_source_is_reused(
        make_checkpoint, host_slots):
    """On a link whose copies complete later (tests/store/links.py), as on CUDA: compute is made to wait for
    each copy, and a disk read into a host or bounce slot waits for the copies from it. Without a host tier:
    the CUDA store's path (disk -> bounce slot -> device slot), on the CPU, through two bounce slots."""
    checkpoint = make_checkpoint(hidden=64, inter=48)  # experts over a block: slots overlap at any placement
    eb = checkpoint.index.topology.expert_bytes
    link = LateLink()
    with ExpertStore(checkpoint.index, StoreConfig(4 * eb, host_slots * eb), LRUPolicy(), LRUPolicy(),
                     link=link, staging=2 if host_slots == 0 else 0) as store:
        staging = store.slot_pools()["staging"].num_slots
        assert (staging, store.host_slots) == ((2, 0) if host_slots == 0 else (0, 2))
        first = store.acquire([K(0, 0), K(0, 1)])  # their copies wait for compute
        second = store.acquire([K(1, 2), K(1, 3)])  # read into the same two host or bounce slots
        link.compute()
        for key, slot in {**first, **second}.items():
            assert_holds_expert(checkpoint, slot, key)
        store.release(list(first) + list(second))


def test_a_fetch_of_experts_that_have_all_landed_asks_the_store_nothing_more(make_checkpoint):
    ckpt = make_checkpoint()
    with make_store(ckpt, device_slots=4, direct_io=False) as store:
        keys = [K(0, 0), K(0, 1)]
        use(store, *keys)  # landed
        asked = []
        store.next_ready = lambda candidates: asked.append(candidates)  # the slow path, per expert
        fetch = store.fetch(keys)
        handed = dict(fetch.ready())
        fetch.release()
        assert asked == [] and set(handed) == set(keys)
        for key, slot in handed.items():
            assert_holds_expert(ckpt, slot, key)
        missed = store.fetch([K(1, 0)])  # a miss: handed out as it lands, through next_ready
        with pytest.raises(TypeError):
            list(missed.ready())
        assert asked == [[K(1, 0)]]


def test_a_direct_read_fills_a_buffer_checked_and_counted_and_enters_no_tier(checkpoint):
    """Host compute's read of a miss only on disk: its bytes in the caller's buffer, checked as the links'
    reads are, counted as disk bytes, and in neither tier."""
    eb = checkpoint.index.topology.expert_bytes
    integrity = RecordingIntegrity(eb, damaged=(K(1, 2),))
    config = StoreConfig(3 * eb, 3 * eb, "cpu", True)
    with ExpertStore(checkpoint.index, config, LRUPolicy(), LRUPolicy(), integrity) as store:
        buffer = torch.zeros(eb, dtype=torch.uint8)
        store.read_direct(K(0, 1), buffer)
        assert_holds_expert(checkpoint, buffer, K(0, 1))
        assert integrity.checked == [K(0, 1)] and store.stats().bytes_read["disk"] == eb
        assert K(0, 1) not in store.resident("device") | store.resident("host") | store.in_flight()
        with pytest.raises(CheckpointError, match="damaged"):
            store.read_direct(K(1, 2), buffer)
