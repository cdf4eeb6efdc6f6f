"""The MoE-Beyond hit-rate protocol: warm-up, pool size, pushes, and the order of predictions."""

from moestream.bench.sim import SimConfig, simulate
from moestream.bench.sim.moe_beyond import pool_slots
from moestream.contracts import Prediction, Predictor
from moestream.policies import POLICIES
from moestream.topology import Topology
from tests.sim import tiny
from tests.synthetic import synthetic_trace


def moe_beyond(policy, trace, **config):
    return simulate(policy, trace, SimConfig(**config), "moe-beyond")


def test_pool_is_a_share_of_all_experts():
    assert pool_slots(1664, 0.10) == 166 and pool_slots(1664, 0.25) == 416 and pool_slots(10, 0.01) == 1


def test_prompts_of_ten_tokens_or_fewer_contribute_nothing():
    topo = tiny.topology()
    prompts = [[[[(t + s) % 4], [t % 4]] for t in range(n)] for s, n in enumerate([10, 3, 10])]
    trace = tiny.trace(prompts, topo)
    m = moe_beyond(POLICIES.create("lru", topo), trace, cache_ratio=0.5)
    assert (m["accesses"], m["hits"], m["hit_rate"], m["scored_prompts"]) == (0, 0, 0.0, 0)


def test_tokens_after_the_warm_up_are_scored():
    topo = tiny.topology()
    prompt = [[[t % 4], [(t + 1) % 4]] for t in range(13)]
    trace = tiny.trace([prompt, prompt[:5]], topo)
    m = moe_beyond(POLICIES.create("lru", topo), trace, cache_ratio=1.0)
    # the pool holds every expert: the 3 scored tokens x 2 layers all hit
    assert (m["accesses"], m["hits"], m["scored_tokens"], m["scored_prompts"], m["num_prompts"]) == (6, 6, 3, 1, 2)


def test_lru_pool_counts_hits_by_hand():
    topo = tiny.topology(num_layers=1)  # 4 experts, a pool of 2 at ratio 0.5
    tokens = [[[e]] for e in (0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 0, 1)]
    m = moe_beyond(POLICIES.create("lru", topo), tiny.trace([tokens], topo), cache_ratio=0.5)
    # scored: 0 1 2 0 1 after the warm-up left {0, 1}: hit, hit, miss (evicts 0), miss, miss
    assert (m["accesses"], m["hits"]) == (5, 2)


class NextOfLast(Predictor):
    """Predicts, for the next layer, the expert after the one the last observed event routed to."""

    def __init__(self, topology):
        super().__init__(topology)
        self.last = None
        self.calls = []

    def observe(self, event):
        self.last = (event.layer, int(event.expert_ids[0, 0]))

    def predict(self, layer_now, horizon_layers):
        self.calls.append((layer_now, self.last and self.last[0]))
        if self.last is None or layer_now < 0 or layer_now + 1 >= self.topology.num_layers:
            return []
        return [Prediction(layer_now + 1, (self.last[1] + 1) % 4, 1.0, 0)]


def test_predictions_for_layer_l_come_after_observing_layer_l_minus_1_only():
    topo = tiny.topology(num_layers=3)
    prompt = [[[t % 4], [(t + 1) % 4], [(t + 2) % 4]] for t in range(14)]
    policy = POLICIES.create("lru", topo)
    policy.predictor = NextOfLast(topo)
    m = moe_beyond(policy, tiny.trace([prompt], topo), cache_ratio=0.25)  # a pool of 3
    calls = policy.predictor.calls
    assert [layer_now for layer_now, _ in calls[:3]] == [-1, 0, 1]
    assert all(observed == layer_now for layer_now, observed in calls if layer_now >= 0)
    # layers 1 and 2 are pushed right and hit; layer 0 (nothing pushed) always misses in a pool of 3
    assert (m["accesses"], m["hits"], m["pushed_per_scored_token"]) == (12, 8, 2.0)


def test_the_random_refill_is_seeded():
    topo = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=1)
    trace = synthetic_trace(topo, num_sequences=4, tokens_per_sequence=20, seed=2)
    rates = [moe_beyond(POLICIES.create("lru", topo), trace, cache_ratio=0.25, seed=s)["hit_rate"] for s in (0, 0, 1)]
    assert rates[0] == rates[1]


def test_oracle_hits_everything_after_the_warm_up():
    topo = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=1)
    trace = synthetic_trace(topo, num_sequences=3, tokens_per_sequence=16, seed=3)
    assert moe_beyond(POLICIES.create("oracle", topo), trace, cache_ratio=0.1)["hit_rate"] == 1.0


def test_lru_lands_near_the_study_on_real_prompts(deepseek_dev_path):
    from moestream.trace.format import load_trace

    trace = load_trace(deepseek_dev_path)
    sample = trace.select(trace.sequence_ids()[:40])
    m = moe_beyond(POLICIES.create("lru", trace.topology), sample, cache_ratio=0.10)
    assert 0.15 < m["hit_rate"] < 0.40  # the study reports about 28 % on its own prompts
    assert m["scored_prompts"] > 0


def test_the_policy_own_eviction_can_replace_lru():
    topo = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=1)
    trace = synthetic_trace(topo, num_sequences=4, tokens_per_sequence=24, seed=6)
    rates = {
        (name, eviction): moe_beyond(POLICIES.create(name, topo), trace, cache_ratio=0.25, protocol_eviction=eviction)["hit_rate"]
        for name, eviction in (("lru", "lru"), ("belady", "lru"), ("belady", "policy"))
    }
    assert rates["belady", "lru"] == rates["lru", "lru"]  # no prediction, the study's LRU pool
    assert rates["belady", "policy"] > rates["lru", "lru"]
