"""ScoredEviction: the heap it keeps between score changes names the same victim as a ranking of
every candidate by (score, recency) at the moment of the call."""

import random

import numpy as np

from moestream.cache import ExpertCache
from moestream.policies.eviction import ScoredEviction
from moestream.topology import ExpertKey

L, E = 4, 8


class TableEviction(ScoredEviction):
    """Scores from a table the test replaces; counts how often the matrix is computed."""

    def __init__(self, table: np.ndarray):
        super().__init__()
        self.table, self.computed = table, 0
        self.stamps: dict[ExpertKey, int] = {}  # the test's own recency record
        self.clock = 0

    def score_inputs(self) -> tuple:
        return (self.table,)

    def score_matrix(self) -> np.ndarray:
        self.computed += 1
        return self.table

    def on_insert(self, key):
        self._stamp(key)
        super().on_insert(key)

    def on_access(self, key):
        self._stamp(key)
        super().on_access(key)

    def _stamp(self, key):
        self.clock += 1
        self.stamps[key] = self.clock


def expected_victim(policy: TableEviction, candidates) -> ExpertKey:
    return min(candidates, key=lambda key: (policy.table[key], policy.stamps[key]))


def test_victims_match_a_full_ranking_through_score_changes_touches_and_pins():
    rng, pick = np.random.default_rng(0), random.Random(0)
    keys = [ExpertKey(layer, e) for layer in range(L) for e in range(E)]
    policy = TableEviction(rng.integers(0, 4, (L, E)).astype(float))  # few values: many ties go by recency
    cache = ExpertCache(10, policy)
    victims = 0
    for step in range(3000):
        if step % 37 == 0:
            policy.table = rng.integers(0, 4, (L, E)).astype(float)
        key = pick.choice(keys)
        if pick.random() < 0.2 and len(cache):
            cache.pin([pick.choice(sorted(cache.resident()))])
        if pick.random() < 0.2:
            cache.unpin(list(cache.pinned()))
        if cache.access(key) is not None:
            continue
        protect = set(pick.sample(keys, 3))
        candidates = [k for k in cache.evictable() if k not in protect]
        if len(cache) == cache.capacity and candidates:
            expected = expected_victim(policy, candidates)
            _, evicted = cache.admit(key, protect=protect)
            assert evicted == expected
            victims += 1
        elif len(cache) < cache.capacity:
            cache.admit(key)
    assert victims > 500
    assert policy.computed < victims // 5  # the matrix is computed per change of its inputs, not per victim


def test_scores_are_recomputed_when_an_input_is_replaced():
    policy = TableEviction(np.zeros((L, E)))
    cache = ExpertCache(2, policy)
    cache.admit(ExpertKey(0, 0))
    cache.admit(ExpertKey(0, 1))
    table = np.zeros((L, E))
    table[0, 0] = 1.0  # (0, 0) is worth keeping now; (0, 1) goes, though (0, 0) is older
    policy.table = table
    assert cache.admit(ExpertKey(1, 0))[1] == ExpertKey(0, 1)


def test_a_run_of_hits_does_not_grow_the_heap_without_bound():
    policy = TableEviction(np.zeros((L, E)))
    cache = ExpertCache(4, policy)
    for e in range(5):  # the fifth admission asks for a victim, which builds the heap
        cache.admit(ExpertKey(0, e))
    for _ in range(10_000):
        cache.access(ExpertKey(0, 4))
    assert policy._heap is None or len(policy._heap) <= 4 * 16 + 1
    assert cache.admit(ExpertKey(1, 0))[1] == ExpertKey(0, 1)  # still the least recent of equal scores
