from moestream.policies.eviction import LRUPolicy
from moestream.store import ExpertStore, InlineExecutor, StoreConfig, ThreadedExecutor
from moestream.store.factory import open_store
from moestream.topology import ExpertKey as K


def test_open_store_on_the_cpu_picks_threaded_transfers_or_inline_ones(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    kinds = {}
    for asynchronous, host in [(True, 0), (True, 2), (False, 0), (False, 2)]:
        config = StoreConfig(4 * eb, host * eb, asynchronous=asynchronous)
        with open_store(checkpoint.index, config, LRUPolicy(), LRUPolicy()) as store:
            kinds[asynchronous, host] = type(store.executor)
    assert kinds == {(True, 0): ThreadedExecutor, (True, 2): ThreadedExecutor,
                     (False, 0): InlineExecutor, (False, 2): InlineExecutor}


def test_a_host_tier_left_apart_is_served_by_the_same_store_with_a_link_per_tier(checkpoint):
    """What open_store builds for CUDA with a host tier, where the tiers are not merged: the same store,
    its disk -> host -> device links following its tiers."""
    index, eb = checkpoint.index, checkpoint.index.topology.expert_bytes
    tiers = {}
    for host in (0, 2):
        config = StoreConfig(4 * eb, host * eb, asynchronous=True)
        with ExpertStore(index, config, LRUPolicy(), LRUPolicy()) as store:
            assert type(store.executor) is ThreadedExecutor
            store.release(store.acquire([K(0, 0)]))
            tiers[host] = (store.device_slots, store.host_slots, store.resident("host"))
    assert tiers == {0: (4, 0, frozenset()), 2: (4, 2, {K(0, 0)})}


def test_on_the_cpu_the_host_budget_joins_the_one_tier(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    config = StoreConfig(3 * eb, 2 * eb, asynchronous=True)
    with open_store(checkpoint.index, config, LRUPolicy(), LRUPolicy()) as store:
        assert (store.device_slots, store.host_slots) == (5, 0)
