"""Stream order on the CPU, through a link whose copies run late (tests/store/links.py): a copy into a device
slot waits for that slot's last reader only; the host never waits for a copy into a device slot, only
before it overwrites a host or staging slot a copy still reads; and every read is checked where it landed
in host memory, never in a device slot. Each case runs both paths up: disk -> host slot -> device slot (a
host tier), and disk -> staging slot -> device slot (the CUDA store's path without a host tier)."""

import pytest

from moestream.contracts import TransferRequest
from moestream.policies.eviction import LRUPolicy
from moestream.store import ExpertStore, StoreConfig
from moestream.store.disk import DiskReader
from moestream.store.pool import SlotPool
from moestream.topology import ExpertKey
from tests.store.checks import RecordingIntegrity
from tests.store.links import LateLink
from tests.store.test_store import assert_holds_expert

K = ExpertKey
PATHS = {"host tier": (3, 0), "staging": (0, 2)}  # host slots, staging slots


def make_store(ckpt, path, link, device_slots=2, chunk_bytes=0, reader=None, integrity=None, asynchronous=False):
    host_slots, staging = PATHS[path]
    eb = ckpt.index.topology.expert_bytes
    config = StoreConfig(device_slots * eb, host_slots * eb, asynchronous=asynchronous, chunk_bytes=chunk_bytes)
    return ExpertStore(ckpt.index, config, LRUPolicy(), LRUPolicy(), integrity, reader=reader, link=link,
                       staging=staging)


def within(pool: SlotPool, address: int, nbytes: int) -> bool:
    start = pool.data.data_ptr()
    return start <= address and address + nbytes <= start + pool.data.numel()


@pytest.mark.parametrize("path", PATHS)
def test_a_copy_into_a_device_slot_waits_for_its_last_reader_not_for_all_compute(checkpoint, path):
    link = LateLink()
    with make_store(checkpoint, path, link) as store:
        slots = store.acquire([K(0, 0), K(0, 1)])
        assert link.afters and set(link.afters) == {None}  # fresh slots: nothing read them before
        link.compute()
        store.release([K(0, 0)])  # compute that read K(0, 0)'s slot has been issued ...
        store.release([K(0, 1)])  # ... and then more compute
        read_first, read_last = link.marks
        issued = len(link.issued)
        got = store.acquire([K(1, 0)])  # evicts K(0, 0), the least recently used, into its slot
        assert got[K(1, 0)].data_ptr() == slots[K(0, 0)].data_ptr()
        assert len(link.afters) > issued
        assert link.afters[issued:] == [read_first] * (len(link.afters) - issued)  # not read_last
        link.compute()
        assert_holds_expert(checkpoint, got[K(1, 0)], K(1, 0))
        store.release([K(1, 0)])


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_the_host_never_waits_for_a_copy_into_a_device_slot(checkpoint, path, asynchronous):
    link = LateLink()
    with make_store(checkpoint, path, link, asynchronous=asynchronous) as store:
        got = store.acquire([K(0, 0), K(1, 2)])  # no host or staging slot is reused
        assert len(link.issued) >= 2 and not link.ran  # handed out with their copies still to run
        link.compute()  # compute was made to wait for them
        assert len(link.ran) == len(link.issued)
        for key, slot in got.items():
            assert_holds_expert(checkpoint, slot, key)
        store.release(list(got))


class OverwriteCheck:
    """The disk reader, refusing to write memory that a copy issued on the link and not yet run still reads."""

    def __init__(self, link: LateLink):
        self.inner, self.link, self.reads = DiskReader(), link, 0

    def read_batch(self, batch):
        pending = self.link.pending_sources()
        for _, dst in batch:
            lo, hi = dst.data_ptr(), dst.data_ptr() + dst.numel()
            assert not any(src < hi and lo < src + n for src, n in pending), "overwrote a copy's source"
        self.reads += 1
        return self.inner.read_batch(batch)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("chunk_bytes", [0, 40])
@pytest.mark.parametrize("path", PATHS)
def test_a_host_or_staging_slot_is_overwritten_only_after_the_copy_from_it(make_checkpoint, path, chunk_bytes):
    """Prefetched experts' copies are left to run (nothing waits for them) while the next reads reuse the
    host or staging slots they copy from; then one round reads more experts than there are staging slots.
    Experts over a block: a slot reused overlaps the last one in its row at any placement."""
    checkpoint = make_checkpoint(hidden=64, inter=48)
    link = LateLink()
    reader = OverwriteCheck(link)
    with make_store(checkpoint, path, link, device_slots=4, chunk_bytes=chunk_bytes, reader=reader) as store:
        for prefetched, fetched in (([K(0, 0), K(0, 1)], [K(1, 0), K(1, 1)]),
                                    ([K(0, 2), K(0, 3)], [K(1, 2), K(1, 3)])):
            store.prefetch([TransferRequest(key, 1.0) for key in prefetched])
            assert link.pending_sources()  # their copies have not run
            got = store.acquire(fetched)  # read into the slots the prefetches' copies read
            link.compute()
            for key, slot in got.items():
                assert_holds_expert(checkpoint, slot, key)
            store.release(fetched)
        fetched = [K(0, 0), K(0, 1), K(1, 0), K(1, 1)]
        got = store.acquire(fetched)
        link.compute()
        for key, slot in got.items():
            assert_holds_expert(checkpoint, slot, key)
        store.release(fetched)
        assert reader.reads >= 5


@pytest.mark.parametrize("chunk_bytes", [0, 40])
@pytest.mark.parametrize("path", PATHS)
def test_reads_are_checked_where_they_landed_in_host_memory_never_in_a_device_slot(checkpoint, path, chunk_bytes):
    eb = checkpoint.index.topology.expert_bytes
    integrity, link = RecordingIntegrity(eb), LateLink()
    with make_store(checkpoint, path, link, chunk_bytes=chunk_bytes, integrity=integrity) as store:
        keys = [K(0, 0), K(0, 1), K(1, 2)]
        for key in keys:
            store.release(store.acquire([key]))
        link.compute()
        pools = store.slot_pools()
        landing = pools["host"] if path == "host tier" else pools["staging"]
        assert integrity.checked == keys
        for key in keys:
            assert sum(n for k, _, n in integrity.chunks if k == key) == eb  # every byte, once
        for _, address, nbytes in integrity.chunks:
            assert within(landing, address, nbytes) and not within(pools["device"], address, nbytes)
