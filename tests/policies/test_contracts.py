"""Contract suites every registered eviction policy and policy must pass.

The lists come from the registries at collection time, so a newly registered policy runs them with
no test code of its own. `check_policy` runs the whole policy suite on one name; the worked example
of docs/adding-a-policy.md goes through it too (tests/docs). The engine half of the contract
(every online policy generates the reference tokens on a tiny random checkpoint) is
tests/runtime/test_engine.py::test_every_online_policy_keeps_tokens_exact.
"""

import dataclasses

import numpy as np
import pytest

from moestream.bench.sim.config import SimConfig
from moestream.bench.sim.cost import get_cost_model
from moestream.bench.sim.protocols import simulate
from moestream.bench.sim.replay import decode_stream
from moestream.cache import ExpertCache
from moestream.contracts import CacheView
from moestream.policies import EVICTIONS, POLICIES
from moestream.policies.driver import PolicyDriver
from moestream.policies.trained import TrainedPolicy
from moestream.predictors.configs import TrainConfig
from moestream.topology import ExpertKey, Topology
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=8, top_k=2, expert_bytes=1024)
HORIZON = 2


@pytest.fixture(scope="module")
def trace():
    return contract_trace()


def contract_trace():
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


def fitted(name, trace):
    cls = POLICIES.get(name)
    extra = {"train": TrainConfig(num_epochs=1)} if issubclass(cls, TrainedPolicy) else {}
    policy = cls(TOPOLOGY, **extra)
    policy.fit(trace)
    policy.prepare(trace)
    return policy


class _Recorder:
    """A mechanism that keeps every (layer_now, predictions, plan) the driver hands it; with
    ask_twice it asks the predictor again at each step, which must change nothing."""

    def __init__(self, driver, resident, ask_twice=False):
        self.driver, self.resident, self.ask_twice, self.steps = driver, resident, ask_twice, []

    def routed(self, event, num_tokens):
        pass

    def predicted(self, layer_now, predictions):
        view = CacheView(self.resident, frozenset(), capacity=4, layer_now=layer_now, num_layers=TOPOLOGY.num_layers)
        given = list(predictions)
        plan = self.driver.plan(predictions, view) if predictions else []
        assert predictions == given, "the planner modified the predictions it was given"
        if self.ask_twice:
            assert self.driver.predict(layer_now) == predictions
        self.steps.append((layer_now, predictions, plan))


def run(policy, trace, resident=frozenset(), ask_twice=False):
    """Every step of the policy through the driver, on read-only events."""
    evictions = [policy.make_eviction(tier) for tier in ("device", "host")]
    driver = PolicyDriver(policy, evictions, horizon_layers=HORIZON)
    recorder = _Recorder(driver, resident, ask_twice)
    driver.run(map(_read_only, decode_stream(trace)), recorder)
    return recorder.steps


def _read_only(it):
    """The iteration with every array frozen: a policy that writes into its inputs fails."""
    for value in [*vars(it.ctx).values(), *(a for event in it.events for a in vars(event).values())]:
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    return it


def check_predictions_are_valid_and_within_the_horizon(name, trace):
    for layer_now, predictions, _ in run(fitted(name, trace), trace):
        for p in predictions:
            assert 0 <= p.layer < TOPOLOGY.num_layers and 0 <= p.expert < TOPOLOGY.num_experts
            assert 0.0 <= p.score <= 1.0 and p.tokens_ahead >= 0
            ahead = p.layer - layer_now + p.tokens_ahead * TOPOLOGY.num_layers
            assert 1 <= ahead <= HORIZON, f"{p} is {ahead} layers ahead of {layer_now}"


def check_plans_skip_resident_and_respect_capacity(name, trace):
    resident = frozenset(ExpertKey(layer, 0) for layer in range(TOPOLOGY.num_layers))
    for _, _, plan in run(fitted(name, trace), trace, resident):
        assert len(plan) <= 4
        assert not {r.key for r in plan} & resident
        assert len({r.key for r in plan}) == len(plan)


def check_deterministic(name, trace):
    assert run(fitted(name, trace), trace) == run(fitted(name, trace), trace)


def check_predict_leaves_state_alone(name, trace):
    assert run(fitted(name, trace), trace, ask_twice=True) == run(fitted(name, trace), trace)


def check_each_tier_gets_its_own_eviction_policy(name, trace):
    policy = fitted(name, trace)
    assert policy.make_eviction("device") is not policy.make_eviction("host")


def check_replays_in_the_simulator(name, trace):
    for protocol, eviction in (("stream", "lru"), ("moe-beyond", "lru"), ("moe-beyond", "policy")):
        config = SimConfig(cache_ratio=0.25, cost=get_cost_model("pcie4-consumer"), protocol_eviction=eviction)
        first = simulate(fitted(name, trace), trace, config, protocol)
        assert 0.0 <= first["hit_rate"] <= 1.0
        assert simulate(fitted(name, trace), trace, config, protocol) == first


POLICY_CHECKS = (
    check_predictions_are_valid_and_within_the_horizon,
    check_plans_skip_resident_and_respect_capacity,
    check_deterministic,
    check_predict_leaves_state_alone,
    check_each_tier_gets_its_own_eviction_policy,
    check_replays_in_the_simulator,
)


@pytest.mark.parametrize("check", POLICY_CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", POLICIES.names())
def test_policy_contract(name, check, trace):
    check(name, trace)


def test_unknown_policy_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="known: .*lru"):
        POLICIES.get("no-such-policy")
