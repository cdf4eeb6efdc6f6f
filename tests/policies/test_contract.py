"""Contract suites every registered eviction policy and policy must pass."""

import dataclasses

import numpy as np
import pytest

from moestream.cache import ExpertCache
from moestream.policies import EVICTIONS, POLICIES
from moestream.policies.base import CacheView
from moestream.topology import ExpertKey, Topology
from moestream.trace.replay import decode_stream
from moestream.trace.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=8, top_k=2, expert_bytes=1024)


@pytest.fixture(scope="module")
def trace():
    base = synthetic_trace(TOPOLOGY, num_sequences=6, tokens_per_sequence=12, seed=3)
    # router inputs too, so that designs that need them (Policy.trace_needs) can fit and run
    hidden = np.random.default_rng(3).standard_normal((base.num_tokens, TOPOLOGY.num_layers, 8))
    return dataclasses.replace(base, hidden=hidden.astype(np.float16))


@pytest.mark.parametrize("name", EVICTIONS.names())
def test_eviction_victim_is_an_offered_candidate(name):
    policy = EVICTIONS.create(name)
    keys = [ExpertKey(layer, expert) for layer in range(2) for expert in range(4)]
    for key in keys:
        policy.on_insert(key)
    for key in keys[::3]:
        policy.on_access(key)
    for subset in (keys, keys[2:5], keys[-1:]):
        assert policy.victim(subset) in subset


@pytest.mark.parametrize("name", EVICTIONS.names())
def test_eviction_policy_drives_a_cache_within_capacity(name):
    cache = ExpertCache(3, EVICTIONS.create(name))
    for expert in [0, 1, 2, 0, 3, 4, 0, 5, 1, 2]:
        key = ExpertKey(0, expert)
        if cache.access(key) is None:
            cache.admit(key)
        assert key in cache and len(cache) <= 3


def _policy(name, trace):
    policy = POLICIES.create(name, TOPOLOGY)
    policy.fit(trace)
    policy.prepare(trace)
    return policy


def _run(policy, trace, horizon=2):
    """Feed the policy the engine's call order; yield each prediction list with its layer."""
    evictions = {tier: policy.make_eviction(tier) for tier in ("device", "host")}
    observers = policy.observers() + list(evictions.values())
    for it in decode_stream(trace):
        for observer in observers:
            observer.begin_iteration(it.ctx)
        for event in it.events:
            for observer in observers:
                observer.observe(event)
            yield event.layer, policy.predictor.predict(event.layer, horizon)
        for seq in it.finished:
            for observer in observers:
                observer.end_sequence(seq)


@pytest.mark.parametrize("name", POLICIES.names())
def test_predictions_name_real_experts_of_future_layers(name, trace):
    policy = _policy(name, trace)
    for layer_now, predictions in _run(policy, trace):
        for p in predictions:
            assert 0 <= p.layer < TOPOLOGY.num_layers and 0 <= p.expert < TOPOLOGY.num_experts
            assert 0.0 <= p.score <= 1.0 and p.tokens_ahead >= 0
            assert p.layer > layer_now or p.tokens_ahead > 0


@pytest.mark.parametrize("name", POLICIES.names())
def test_plans_skip_resident_and_respect_capacity(name, trace):
    policy = _policy(name, trace)
    resident = frozenset(ExpertKey(layer, 0) for layer in range(TOPOLOGY.num_layers))
    for layer_now, predictions in _run(policy, trace):
        view = CacheView(resident, frozenset(), capacity=4, layer_now=layer_now, num_layers=TOPOLOGY.num_layers)
        plan = policy.planner.plan(predictions, view)
        assert len(plan) <= 4
        assert not {r.key for r in plan} & resident
        assert len({r.key for r in plan}) == len(plan)


@pytest.mark.parametrize("name", POLICIES.names())
def test_each_tier_gets_its_own_eviction_policy(name, trace):
    policy = _policy(name, trace)
    assert policy.make_eviction("device") is not policy.make_eviction("host")


def test_unknown_policy_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="known: .*lru"):
        POLICIES.get("no-such-policy")
