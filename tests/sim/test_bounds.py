"""Belady and the oracle: exact knowledge of the replay, and the bounds they give."""

import numpy as np
import pytest

from moestream.bench.sim import SimConfig, replay, simulate
from moestream.bench.sim.bounds import NEVER, FutureIndex, LookaheadEviction, OfflinePolicyError
from moestream.policies import POLICIES
from moestream.policies.eviction import LRUPolicy
from moestream.topology import ExpertKey, Topology
from tests.sim import tiny
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=tiny.MB)


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(TOPOLOGY, num_sequences=6, tokens_per_sequence=10, seed=5)


def _brute_next_use(iterations, step, layer, key):
    """The first (iteration, layer) after (step, layer) that needs key, as iteration * L + layer."""
    num_layers = TOPOLOGY.num_layers
    for s in range(step, len(iterations)):
        for lay in range(num_layers):
            if (s, lay) > (step, layer) and lay == key.layer and key.expert in iterations[s].events[lay].expert_ids:
                return s * num_layers + lay
    return NEVER


@pytest.mark.parametrize(
    "make", [replay.decode_stream, replay.prefill, lambda t: replay.batched_decode(t, 3)], ids=["decode", "prefill", "batched"]
)
def test_future_index_knows_every_next_use(trace, make):
    iterations = list(make(trace))
    future = FutureIndex(TOPOLOGY)
    future.reset(trace)
    keys = list(TOPOLOGY.keys())
    for it in iterations[:12]:
        future.begin(it.ctx)
        for event in it.events:
            future.observe(event)
            for key in keys[::3]:
                assert future.next_use(key) == _brute_next_use(iterations, it.ctx.step, event.layer, key)


def test_prefill_of_one_token_prompts_first_is_followed():
    topo = tiny.topology()
    t = tiny.trace([[[[0], [1]]], [[[2], [3]], [[1], [0]]]], topo)  # a one-token prompt, then two tokens
    future = FutureIndex(topo)
    future.reset(t)
    for it in replay.prefill(t):
        future.begin(it.ctx)
        for event in it.events:
            future.observe(event)
    assert future.next_use(ExpertKey(0, 2)) == NEVER


def test_unprepared_offline_policy_says_so(trace):
    policy = POLICIES.create("belady", TOPOLOGY)
    it = next(replay.decode_stream(trace))
    with pytest.raises(OfflinePolicyError, match="prepare"):
        policy.predictor.begin_iteration(it.ctx)


def test_oracle_predicts_exactly_the_next_layers(trace):
    policy = POLICIES.create("oracle", TOPOLOGY)
    policy.prepare(trace)
    iterations = list(replay.decode_stream(trace))
    for it in iterations[:-1]:
        policy.predictor.begin_iteration(it.ctx)
        for event in it.events:
            policy.predictor.observe(event)
            predicted = {(p.layer, p.expert, p.tokens_ahead) for p in policy.predictor.predict(event.layer, 2)}
            expected = set()
            for target in (event.layer + 1, event.layer + 2):
                ahead, layer = divmod(target, TOPOLOGY.num_layers)
                nxt = iterations[it.ctx.step + ahead].events[layer].expert_ids.ravel().tolist()
                expected |= {(layer, e, ahead) for e in nxt}
            assert predicted == expected


def test_belady_beats_lru_on_a_cyclic_sequence():
    topo = tiny.topology(num_layers=1)  # 4 experts, 2 slots at ratio 0.5
    t = tiny.trace([[[[e]] for e in (0, 1, 2) * 4]], topo)
    config = SimConfig(cache_ratio=0.5, cost=tiny.cost())
    lru = simulate(POLICIES.create("lru", topo), t, config)
    belady = simulate(POLICIES.create("belady", topo), t, config)
    assert lru["hits"] == 0  # a cycle one longer than the cache defeats LRU
    # MIN: miss a, b, c (evicts b), hit a, miss b (evicts a), hit c, ...: every other access after 3
    assert belady["hits"] == 5 and belady["hit_rate"] > lru["hit_rate"]


def _fast_link():
    return tiny.cost(compute_ms=5.0, link_gbps=100.0)  # transfers hide behind compute


@pytest.mark.parametrize("name", [n for n in POLICIES.names() if not POLICIES.get(n).offline])
def test_oracle_hit_rate_bounds_every_online_policy(name, trace):
    import dataclasses

    hidden = np.random.default_rng(0).standard_normal((trace.num_tokens, TOPOLOGY.num_layers, 8)).astype(np.float16)
    full = dataclasses.replace(trace, hidden=hidden)
    train, test = full.split(0.5, seed=1)
    config = SimConfig(cache_ratio=0.25, cost=_fast_link(), horizon_layers=2)
    online = POLICIES.create(name, TOPOLOGY)
    online.fit(train)
    oracle = simulate(POLICIES.create("oracle", TOPOLOGY), test, config)
    assert oracle["hit_rate"] >= simulate(online, test, config)["hit_rate"]


def test_belady_is_at_least_lru_and_lfu_on_synthetic_traces(trace):
    config = SimConfig(cache_ratio=0.25, cost=tiny.cost())
    rates = {name: simulate(POLICIES.create(name, TOPOLOGY), trace, config)["hit_rate"] for name in ("lru", "lfu", "belady")}
    assert rates["belady"] >= max(rates["lru"], rates["lfu"])


class _Window(POLICIES.get("lookahead-1")):
    num_tokens = 0


class _Unbounded(POLICIES.get("lookahead-1")):
    num_tokens = 10**6


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_lookahead_spans_lru_to_belady(trace, ratio):
    config = SimConfig(cache_ratio=ratio, cost=tiny.cost())
    hits = lambda policy: simulate(policy, trace, config)["hits"]  # noqa: E731
    assert hits(_Window(TOPOLOGY)) == hits(POLICIES.create("lru", TOPOLOGY))  # no foresight: LRU
    assert hits(_Unbounded(TOPOLOGY)) == hits(POLICIES.create("belady", TOPOLOGY))  # all of it: MIN
    assert hits(POLICIES.create("lookahead-8", TOPOLOGY)) >= hits(POLICIES.create("lru", TOPOLOGY))


class _Newest(LRUPolicy):
    """Evicts the most recently used offered candidate, and records what it was offered."""

    offered = None

    def victim(self, candidates):
        self.offered = list(candidates)
        return next(key for key in reversed(self._order) if key in candidates)


def _lookahead_after_two_tokens(trace, num_tokens):
    iterations = list(replay.decode_stream(trace))
    future, fallback = FutureIndex(TOPOLOGY), _Newest()
    future.reset(trace)
    eviction = LookaheadEviction(future, num_tokens, fallback)
    for it in iterations[:2]:
        future.begin(it.ctx)
        for event in it.events:
            future.observe(event)
            for expert in event.expert_ids.ravel().tolist():
                eviction.on_access(ExpertKey(event.layer, expert))
    return eviction, fallback, future


def test_lookahead_leaves_to_its_fallback_only_the_experts_it_does_not_foresee(trace):
    eviction, fallback, future = _lookahead_after_two_tokens(trace, num_tokens=1)
    candidates = [key for key in TOPOLOGY.keys() if key in fallback._order]
    victim = eviction.victim(candidates)
    horizon = future.position + TOPOLOGY.num_layers
    assert fallback.offered == [key for key in candidates if future.next_use(key) > horizon]
    assert victim == next(key for key in reversed(fallback._order) if key in fallback.offered)


def test_lookahead_evicts_the_one_needed_last_when_it_foresees_every_candidate(trace):
    eviction, fallback, future = _lookahead_after_two_tokens(trace, num_tokens=10**6)
    candidates = [key for key in TOPOLOGY.keys() if future.next_use(key) < NEVER][:5]
    assert eviction.victim(candidates) == max(candidates, key=future.next_use)
    assert fallback.offered is None
