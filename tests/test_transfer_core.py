"""The transfer core's rules, which the stores and the simulator share: lookups, admissions with the
waste of unused prefetches, landings, and that a late prefetch never counts as a prefetch hit."""

import pytest

from moestream.cache import CacheFullError, ExpertCache
from moestream.policies.eviction import LRUPolicy
from moestream.topology import ExpertKey
from moestream.transfer_core import HIT, LATE, MISS, TransferCore

K = ExpertKey


def core(slots=2) -> TransferCore:
    return TransferCore(ExpertCache(slots, LRUPolicy()))


def arrive(c: TransferCore, key, prefetch: bool) -> None:
    c.admit(key)
    c.track(key, f"transfer of {key}")
    c.landed(key, prefetch)


def test_a_landed_prefetch_is_a_prefetch_hit_once_then_a_plain_hit():
    c = core()
    arrive(c, K(0, 1), prefetch=True)
    assert [c.lookup(K(0, 1)) for _ in range(2)] == [HIT, HIT]
    assert (c.counts.hits, c.counts.prefetch_hits) == (2, 1)


def test_a_late_prefetch_is_late_and_never_a_prefetch_hit():
    c = core()
    c.admit(K(0, 1))
    c.track(K(0, 1), "prefetch")
    assert c.lookup(K(0, 1)) == LATE and c.moving[K(0, 1)] == "prefetch"
    c.landed(K(0, 1), prefetch=True)  # a prefetch a layer waited for lands as no unused prefetch
    assert c.lookup(K(0, 1)) == HIT
    assert (c.counts.hits, c.counts.prefetch_hits) == (1, 0)


def test_an_unused_prefetch_evicted_is_wasted_and_a_used_one_is_not():
    c = core(slots=2)
    arrive(c, K(0, 1), prefetch=True)
    arrive(c, K(0, 2), prefetch=True)
    assert c.lookup(K(0, 2)) == HIT
    c.admit(K(0, 3))  # LRU evicts K(0, 1), never used
    c.admit(K(0, 4))  # then K(0, 2), used
    assert (c.counts.evictions, c.counts.wasted) == (2, 1)
    assert c.lookup(K(0, 1)) == MISS


def test_admission_never_evicts_a_pinned_or_protected_expert():
    c = core(slots=2)
    arrive(c, K(0, 1), prefetch=False)
    arrive(c, K(0, 2), prefetch=False)
    c.device.pin([K(0, 1)])
    with pytest.raises(CacheFullError):
        c.admit(K(0, 3), protect={K(0, 2)})
    assert c.device.resident() == {K(0, 1), K(0, 2)}


def test_a_forgotten_transfer_leaves_the_tier_and_is_no_longer_moving():
    c = core()
    c.admit(K(0, 1))
    c.track(K(0, 1), "cancelled")
    c.forget(K(0, 1))
    assert c.lookup(K(0, 1)) == MISS and not c.moving and K(0, 1) not in c.device


def test_a_plan_is_admitted_best_first_keeping_what_it_asked_for_earlier():
    c = core(slots=3)
    for key in (K(0, 1), K(0, 2), K(0, 3)):
        arrive(c, key, prefetch=False)
    c.lookup(K(0, 1))  # LRU order now 2, 3, 1
    brought = c.admit_prefetches([K(0, 2), K(0, 4), K(0, 5), K(0, 6)])
    # 4 evicts 3 (2 is kept by the plan), 5 evicts 1; then every slot is pinned or kept: 6 is refused
    assert brought == [K(0, 4), K(0, 5)]
    assert c.device.resident() == {K(0, 2), K(0, 4), K(0, 5)}
    assert c.device.pinned() == {K(0, 4), K(0, 5)}  # the transfers' pins, until they land
