"""The policy's cost per MoE layer decision, as `bench policies` prints it.

A decision is everything the policy does for one layer on the compute thread: its observer hooks,
predict and plan (timed by the driver), and the eviction hooks the device tier calls as the layer's
experts are served and the plan's prefetches are admitted (`TimedEviction`, around each hook); both
report to one tracer, whose "policy" lane the layer's time is read from. An
iteration's begin and sequence ends count in the layer that follows them. A policy whose predictor
runs on a worker in the engine runs inline here, so the worker's work is counted too. Knows the
contracts and the cache, not any policy.
"""

from __future__ import annotations

import copy

import numpy as np

from moestream.bench.sim.replay import decode_stream
from moestream.cache import CacheFullError, ExpertCache
from moestream.contracts import CacheView, Policy
from moestream.policies.driver import PolicyDriver, TimedEviction
from moestream.topology import ExpertKey
from moestream.trace.schema import Trace
from moestream.tracer import LaneTotal, Tracer


def overhead_us_per_layer(policy: Policy, sample: Trace, horizon_layers: int, cache_ratio: float = 0.1) -> float:
    """Median microseconds of the policy's work per layer decision over the sample's decode tokens."""
    policy = copy.deepcopy(policy)
    policy.prepare(sample)
    eviction = policy.make_eviction("device")
    tracer = Tracer()
    driver = PolicyDriver(policy, [eviction], horizon_layers=horizon_layers, tracer=tracer)
    topology = sample.topology
    capacity = max(topology.top_k, int(topology.total_experts * cache_ratio))
    timer = LayerTimer(driver, ExpertCache(capacity, TimedEviction(eviction, tracer)), topology.num_layers)
    driver.run(decode_stream(sample), timer)
    return 1e6 * float(np.median(timer.seconds)) if timer.seconds else 0.0


class LayerTimer:
    """A mechanism in no time: serves each layer's experts from a device tier (demand first), admits
    the plan's requests, and keeps the policy's time for each layer decision."""

    def __init__(self, driver: PolicyDriver, cache: ExpertCache, num_layers: int):
        self.driver, self.cache, self.num_layers = driver, cache, num_layers
        self.seconds: list[float] = []
        self._counted = 0.0
        self._needed: list[ExpertKey] = []
        self._protect: frozenset[ExpertKey] = frozenset()  # the layer's experts, as the engine's own: a set

    def routed(self, event, num_tokens: int) -> None:
        self._needed = [ExpertKey(event.layer, int(e)) for e in sorted(set(event.expert_ids.ravel().tolist()))]
        self._protect = frozenset(self._needed)
        for key in self._needed:
            if self.cache.access(key) is None:
                self.cache.admit(key, protect=self._protect)

    def predicted(self, layer_now: int, predictions: list) -> None:
        if predictions:
            view = CacheView(self.cache.resident(), frozenset(), self.cache.capacity, layer_now, self.num_layers)
            for request in self.driver.plan(predictions, view):
                try:
                    self.cache.admit(request.key, protect=self._protect)
                except CacheFullError:
                    break
        if layer_now >= 0:
            spent = self.driver.tracer.totals().get("policy", LaneTotal()).seconds  # the driver's and the hooks'
            self.seconds.append(spent - self._counted)
            self._counted = spent
