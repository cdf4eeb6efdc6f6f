"""The per-layer cost of a policy counts the eviction hooks the device tier calls, not only the driver's."""

import time

from moestream.bench.tools.overhead import overhead_us_per_layer
from moestream.policies import POLICIES
from moestream.policies.eviction import LRUPolicy
from tests.sim import tiny
from tests.synthetic import synthetic_trace


class SlowVictim(LRUPolicy):
    def victim(self, candidates):
        time.sleep(0.002)
        return super().victim(candidates)


def test_a_slow_victim_choice_shows_in_the_cost_per_layer():
    topology = tiny.topology(num_layers=2, num_experts=8, top_k=2)
    trace = synthetic_trace(topology, num_sequences=2, tokens_per_sequence=12)
    lru = POLICIES.create("lru", topology)
    slow = POLICIES.create("lru", topology)
    slow.make_eviction = lambda tier: SlowVictim()
    fast_us = overhead_us_per_layer(lru, trace, horizon_layers=1)
    slow_us = overhead_us_per_layer(slow, trace, horizon_layers=1)
    assert fast_us < 1000 <= slow_us  # a layer that misses evicts at least once at a 10% tier
