from moestream.policies.eviction import LRUPolicy
from moestream.store import StoreConfig
from moestream.topology import ExpertKey as K
from moestream.store.async_store import AsyncExpertStore
from moestream.store.factory import open_store, store_kind
from moestream.store.inline import InlineStore


def test_open_store_on_the_cpu_picks_the_one_tier_asynchronous_store_or_the_synchronous_one(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    kinds = {}
    for asynchronous, host in [(True, 0), (True, 2), (False, 0), (False, 2)]:
        config = StoreConfig(4 * eb, host * eb, asynchronous=asynchronous)
        with open_store(checkpoint.index, config, LRUPolicy(), LRUPolicy()) as store:
            kinds[asynchronous, host] = type(store)
    assert kinds == {(True, 0): AsyncExpertStore, (True, 2): AsyncExpertStore,
                     (False, 0): InlineStore, (False, 2): InlineStore}


def test_a_host_tier_left_apart_is_served_by_the_asynchronous_store(checkpoint):
    """What open_store builds for CUDA with a host tier, where the tiers are not merged: the same store,
    its disk -> host -> device links following its tiers."""
    index, eb = checkpoint.index, checkpoint.index.topology.expert_bytes
    tiers = {}
    for host in (0, 2):
        config = StoreConfig(4 * eb, host * eb, asynchronous=True)
        with store_kind(config)(index, config, LRUPolicy(), LRUPolicy()) as store:
            assert type(store) is AsyncExpertStore
            store.release(store.acquire([K(0, 0)]))
            tiers[host] = (store.device_slots, store.host_slots, store.resident("host"))
    assert tiers == {0: (4, 0, frozenset()), 2: (4, 2, {K(0, 0)})}


def test_on_the_cpu_the_host_budget_joins_the_one_tier(checkpoint):
    eb = checkpoint.index.topology.expert_bytes
    config = StoreConfig(3 * eb, 2 * eb, asynchronous=True)
    with open_store(checkpoint.index, config, LRUPolicy(), LRUPolicy()) as store:
        assert (store.device_slots, store.host_slots) == (5, 0)
