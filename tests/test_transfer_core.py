"""The transfer core's rules, which the stores and the simulator share: residency changes at lookups and
plans only (never at a landing), a late prefetch is a hit but never a prefetch hit, an unused prefetch
evicted is wasted, pins come from the layer and the current plan, and a demand releases the plan's."""

import pytest

from moestream.cache import CacheFullError, ExpertCache
from moestream.link_model import ModelledLink
from moestream.policies.eviction import LRUPolicy
from moestream.topology import ExpertKey
from moestream.transfer_core import HIT, LATE, MISS, TransferCore

K = ExpertKey


def core(slots=2, displaced=None) -> TransferCore:
    return TransferCore(ExpertCache(slots, LRUPolicy()), displaced or (lambda record: None))


RECORDS: dict = {}  # one record per key, as a driver keeps its transfer


def record(key) -> str:
    return RECORDS.setdefault(key, f"transfer of {key}")


def prefetched(c: TransferCore, *keys, land=True) -> None:
    """A plan brings keys in (each tracked as moving); land: their bytes arrive."""
    assert c.admit_prefetches(list(keys)) == list(keys)
    for key in keys:
        c.track(key, record(key))
        if land:
            assert c.landed(key, record(key))


def test_a_landed_prefetch_is_a_prefetch_hit_once_then_a_plain_hit():
    c = core()
    prefetched(c, K(0, 1))
    assert [c.lookup(K(0, 1)) for _ in range(2)] == [HIT, HIT]
    assert (c.counts.hits, c.counts.prefetch_hits, c.counts.late) == (2, 1, 0)


def test_a_late_prefetch_is_a_late_hit_and_never_a_prefetch_hit():
    c = core()
    prefetched(c, K(0, 1), land=False)
    assert c.lookup(K(0, 1)) == LATE and c.moving[K(0, 1)] == record(K(0, 1))
    assert c.landed(K(0, 1), record(K(0, 1)))  # residency does not change when it lands
    assert c.lookup(K(0, 1)) == HIT
    assert (c.counts.hits, c.counts.late, c.counts.misses, c.counts.prefetch_hits) == (2, 1, 0, 0)


def test_an_unused_prefetch_evicted_is_wasted_landed_or_not():
    c = core(slots=3)
    prefetched(c, K(0, 1))
    prefetched(c, K(0, 2), land=False)
    c.end_plan()
    assert c.lookup(K(1, 0)) == MISS
    c.admit_demand(K(1, 0))
    late, missed = c.fetch_layer([K(2, 0), K(2, 1)])  # LRU evicts K(0, 1) then K(0, 2), both unused
    assert (late, missed) == ([], [K(2, 0), K(2, 1)])
    assert (c.counts.evictions, c.counts.wasted) == (2, 2)
    assert c.lookup(K(0, 1)) == MISS and not c.moving  # K(0, 2)'s transfer was handed back (displaced)


def test_an_expert_evicted_while_it_moves_is_handed_to_the_driver():
    displaced = []
    c = core(slots=1, displaced=displaced.append)
    prefetched(c, K(0, 1), land=False)
    c.end_plan()
    c.fetch_layer([K(1, 0)])
    assert displaced == [record(K(0, 1))] and K(0, 1) not in c.moving
    assert not c.landed(K(0, 1), record(K(0, 1)))  # its late landing means nothing


def test_admission_never_evicts_a_pinned_expert():
    c = core(slots=2)
    c.fetch_layer([K(0, 1), K(0, 2)])  # the layer's pins until it unpins
    with pytest.raises(CacheFullError):
        c.admit(K(0, 3))
    assert c.admit_prefetches([K(1, 0)]) == []
    assert c.device.resident() == {K(0, 1), K(0, 2)}


def test_a_failed_layer_admission_leaves_nothing_behind():
    c = core(slots=2)
    c.device.pin([K(0, 1)])
    c.admit_demand(K(0, 1))
    with pytest.raises(CacheFullError):
        c.fetch_layer([K(1, 0), K(1, 1)])  # one slot left for two misses
    assert c.device.resident() == {K(0, 1)} and c.device.pinned() == {K(0, 1)}


def test_a_forgotten_transfer_leaves_the_tier_and_is_no_longer_moving():
    c = core()
    prefetched(c, K(0, 1), land=False)
    c.forget(K(0, 1))
    assert c.lookup(K(0, 1)) == MISS and not c.moving and K(0, 1) not in c.device and not c.plan


def test_a_plan_is_admitted_best_first_keeping_what_it_asked_for_earlier():
    c = core(slots=3)
    for key in (K(0, 1), K(0, 2), K(0, 3)):
        c.admit_demand(key)
    c.lookup(K(0, 1))  # LRU order now 2, 3, 1
    brought = c.admit_prefetches([K(0, 2), K(0, 4), K(0, 5), K(0, 6)])
    # 4 evicts 3 (2 is kept by the plan), 5 evicts 1; then every slot is pinned or kept: 6 is refused
    assert brought == [K(0, 4), K(0, 5)]
    assert c.device.resident() == {K(0, 2), K(0, 4), K(0, 5)}
    assert c.device.pinned() == {K(0, 4), K(0, 5)}  # the plan's pins, until the next plan


def test_the_next_plan_releases_the_last_ones_pins_and_keeps_its_experts_in_flight_until_used():
    c = core(slots=4)
    prefetched(c, K(1, 0), K(1, 1))  # landed or not makes no difference below
    c.lookup(K(1, 0))
    c.fetch_layer([K(0, 0)])  # a demand load of the layer just routed
    view = c.plan_view(layer_now=0, num_layers=2)
    assert view.in_flight == {K(1, 1), K(0, 0)} and view.resident == {K(1, 0)}
    assert c.device.pinned() == {K(0, 0)} and set(c.device.resident()) == {K(0, 0), K(1, 0), K(1, 1)}


def test_a_demand_releases_the_plans_pins_lowest_priority_first():
    c = core(slots=3)
    prefetched(c, K(1, 0), K(1, 1), K(1, 2), land=False)  # every slot pinned by the plan
    late, missed = c.fetch_layer([K(0, 0)])
    assert missed == [K(0, 0)] and K(1, 2) not in c.device  # the lowest-priority request gave way
    assert c.plan == [K(1, 0), K(1, 1)] and c.device.pinned() == {K(0, 0), K(1, 0), K(1, 1)}


def test_a_plan_evicts_none_of_the_last_plans_experts_that_no_lookup_has_used():
    c = core(slots=3)
    prefetched(c, K(1, 0), K(1, 1), land=False)
    c.lookup(K(1, 0))  # used: now any plan may evict it
    c.fetch_layer([K(0, 0)])  # pinned by its layer
    c.plan_view(layer_now=0, num_layers=2)
    assert c.admit_prefetches([K(2, 0), K(2, 1)]) == [K(2, 0)]  # K(2, 0) evicts K(1, 0); K(1, 1) is kept
    assert K(1, 1) in c.device and K(2, 0) in c.device and c.counts.evictions == 1


def test_a_prefetch_a_demand_load_evicts_leaves_the_modelled_links_backlog():
    """1 ms per expert's read, layers of 2 ms: nothing moves between the plan and the lookup (same layer)."""
    link = ModelledLink(bytes_per_ms=100.0, layer_ms=2.0, expert_bytes=100, num_layers=4, tail_ms=1.0)
    c = TransferCore(ExpertCache(2, LRUPolicy()), lambda record: None, link)
    c.plan_view(layer_now=0, num_layers=4)
    prefetched(c, K(2, 0), K(2, 1), land=False)  # both slots, pinned by the plan
    assert c.link_state(0).backlog_bytes == 200.0
    late, missed = c.fetch_layer([K(0, 3)])  # a miss: the plan's lowest request gives way and is evicted
    assert missed == [K(0, 3)] and K(2, 1) not in c.device
    assert c.link_state(0).backlog_bytes == 200.0  # K(2, 0)'s read and the demand load: K(2, 1)'s is gone
