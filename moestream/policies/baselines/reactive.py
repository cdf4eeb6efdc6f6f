"""Reactive baselines: no prediction, only an eviction policy."""

from __future__ import annotations

from moestream.contracts import EVICTIONS, POLICIES, EvictionPolicy, Policy


@POLICIES.register("lru")
class LRU(Policy):
    """No prefetch; least-recently-used eviction (a Policy's defaults)."""


@POLICIES.register("lfu")
class LFU(Policy):
    """No prefetch; least-frequently-used eviction."""

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return EVICTIONS.create("lfu")
