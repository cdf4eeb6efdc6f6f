"""The stream simulator against counts worked out by hand on tiny traces (1 ms per transfer)."""

import numpy as np
import pytest

from moestream.bench.sim import SimConfig, simulate
from moestream.contracts import Prediction, Predictor
from moestream.errors import BudgetError
from moestream.policies import POLICIES
from moestream.policies.planning import BandwidthAwarePlanner, ScorePlanner
from moestream.topology import ExpertKey, Topology
from moestream.trace.replay import batched_rows
from tests.sim import tiny
from tests.synthetic import synthetic_trace


def run(policy, trace, **config):
    return simulate(policy, trace, SimConfig(**config), "stream")


def test_demand_loads_stall_compute_and_repeat_tokens_hit():
    topo = tiny.topology()  # 2 layers x 4 experts, top-1, 8 experts in all
    trace = tiny.trace([[[[0], [0]], [[0], [0]], [[1], [1]], [[0], [0]]]], topo)
    m = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, cost=tiny.cost(compute_ms=2.0))
    assert (m["hits"], m["accesses"]) == (4, 8)
    assert m["stall_ms_per_token"] == pytest.approx(4 * 1.0 / 4)  # four 1 ms demand loads
    assert m["resident_ms"] == pytest.approx(4 * 2 * 2.0)
    assert m["tpot_ratio_vs_resident"] == pytest.approx(20.0 / 16.0)
    assert m["bytes_per_token"] == pytest.approx(4 * tiny.MB / 4)
    assert m["per_layer_hit_rate"] == [0.5, 0.5]
    assert m["tier_hit_rate"] == {"device": 0.5, "host": 1.0}


def test_prefetch_in_time_is_a_hit():
    topo = tiny.topology()
    trace = tiny.trace([[[[0], [1]]]], topo)
    policy = tiny.scripted(topo, {1: [1]})  # predicts layer 1's expert right
    m = run(policy, trace, cache_ratio=0.5, cost=tiny.cost(compute_ms=2.0), horizon_layers=1)
    # layer 0: 1 ms demand load; the prefetch runs 1..2 ms while layer 0 computes 1..3 ms
    assert (m["hits"], m["prefetches"], m["prefetch_hits"]) == (1, 1, 1)
    assert m["stall_ms"] == pytest.approx(1.0)
    assert (m["late_prefetches"], m["wasted_prefetches"]) == (0, 0)


def test_prefetch_arriving_after_the_gate_is_late_and_stalls_the_rest():
    topo = tiny.topology()
    trace = tiny.trace([[[[0], [1]]]], topo)
    policy = tiny.scripted(topo, {1: [1]})
    m = run(policy, trace, cache_ratio=0.5, cost=tiny.cost(compute_ms=0.5), horizon_layers=1)
    # layer 0 computes 1..1.5 ms; the prefetch lands at 2 ms: layer 1 waits 0.5 ms, a late hit
    assert (m["hits"], m["late_prefetches"], m["late_prefetch_ratio"], m["prefetch_hits"]) == (1, 1, 1.0, 0)
    assert m["stall_ms"] == pytest.approx(1.5)


def test_wrong_prefetch_evicted_unused_is_wasted():
    topo = tiny.topology(num_layers=3)
    trace = tiny.trace([[[[0], [1], [2]]]], topo)
    policy = tiny.scripted(topo, {1: [2]})  # wrong: layer 1 needs expert 1
    m = run(policy, trace, cache_ratio=2 / 12, cost=tiny.cost(), horizon_layers=1)  # 2 slots
    # the prefetch takes its slot when planned, after layer 0's demand load: layer 1's demand load
    # evicts layer 0's expert, layer 2's the least recent, the prefetched, never used expert
    assert (m["hits"], m["prefetches"], m["wasted_prefetches"], m["wasted_prefetch_ratio"]) == (0, 1, 1, 1.0)
    assert m["demand_fetches"] == 3


def test_doubling_link_bandwidth_halves_a_transfer_bound_stall():
    topo = tiny.topology()
    trace = tiny.trace([[[[e], [e]] for e in range(4)] * 2], topo)  # every access misses at 2 slots
    stalls = [
        run(POLICIES.create("lru", topo), trace, cache_ratio=0.25, cost=tiny.cost(link_gbps=gbps))["stall_ms"]
        for gbps in (1.0, 2.0)
    ]
    assert stalls[0] > 0 and stalls[1] == pytest.approx(stalls[0] / 2)


def test_a_layers_demand_loads_pay_the_batch_cost_once():
    from dataclasses import replace

    topo = tiny.topology(top_k=2)  # 2 layers x 4 experts, top-2
    trace = tiny.trace([[[[0, 1], [2, 3]], [[2, 3], [0, 1]]]], topo)  # every access misses at 2 slots per layer
    cost = tiny.cost()
    plain = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, cost=cost)
    batched = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, cost=replace(cost, demand_batch_ms=0.5))
    assert plain["hits"] == batched["hits"] == 0
    layers = 2 * 2  # two tokens x two layers, each layer's two misses one batch
    assert batched["stall_ms"] - plain["stall_ms"] == pytest.approx(layers * 0.5)


def test_a_layer_computes_what_it_holds_while_its_misses_load_in_the_engines_expert_order():
    from dataclasses import replace

    topo = tiny.topology(top_k=2)  # 2 layers x 4 experts, top-2; 4 slots at 0.5
    trace = tiny.trace([[[[2, 3], [2, 3]], [[0, 3], [0, 3]]]], topo)  # token 1: expert 0 misses, expert 3 hits
    cost = replace(tiny.cost(), routed_expert_ms=0.5)  # 1 ms per read, 0.5 ms per routed expert

    def stall(order, model=cost):
        m = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, cost=model, expert_order=order)
        assert (m["hits"], m["accesses"]) == (2, 8)
        return m["stall_ms"]

    # token 0, each layer: its two misses are one demand round (the engine's rounds), landing together at 2 ms:
    # it waits 2 ms in every order. Token 1: the miss lands at 1 ms; "ready" computes the hit first, 0 to 0.5 ms.
    assert stall("loaded") == pytest.approx(2 * 2.0 + 2 * 1.0)
    assert stall("ready") == pytest.approx(2 * 2.0 + 2 * 0.5)
    assert stall("given") == pytest.approx(2 * 2.0 + 2 * 1.0)  # expert 0 first: it waits the whole 1 ms
    slow = replace(cost, routed_expert_ms=1000.0)  # a layer's experts never take more than its 2 ms of compute
    assert stall("ready", slow) == pytest.approx(2 * 2.0 + 2 * 0.0)  # 1 ms each: the hit computes 0-1
    assert stall("given", slow) == pytest.approx(2 * 2.0 + 2 * 1.0)
    without = replace(cost, routed_expert_ms=0.0)
    assert stall("ready", without) == stall("given", without) == stall("loaded", without) == stall("loaded")


def test_the_planner_sees_a_layers_demand_loads_in_flight_as_the_engines_store_shows_them():
    from moestream.policies.planning import ScorePlanner

    class Recording(ScorePlanner):
        def __init__(self):
            super().__init__()
            self.in_flight = []

        def plan(self, predictions, view):
            self.in_flight.append((view.layer_now, set(view.in_flight)))
            assert not set(view.in_flight) & set(view.resident)  # resident: landed, as the store shows it
            return super().plan(predictions, view)

    topo = tiny.topology()
    trace = tiny.trace([[[[0], [1]], [[0], [1]]]], topo)  # token 0 misses both layers, token 1 hits both
    policy = tiny.scripted(topo, {1: [2]})
    policy.planner = Recording()
    run(policy, trace, cache_ratio=0.5, cost=tiny.cost(compute_ms=2.0), horizon_layers=1)
    seen = dict(policy.planner.in_flight[:1])  # token 0, after layer 0: its demand load lands 1 ms later
    assert seen == {0: {ExpertKey(0, 0)}}
    assert all(not keys for layer, keys in policy.planner.in_flight[1:])  # later plans: nothing is moving


def test_an_unknown_expert_order_is_a_config_error():
    from moestream.bench.sim.config import SimConfigError

    with pytest.raises(SimConfigError, match="expert order"):
        SimConfig(cache_ratio=0.5, expert_order="random")


class Spy(Predictor):
    def __init__(self, topology, log):
        super().__init__(topology)
        self.log = log

    def begin_iteration(self, ctx):
        self.log.append(("begin", ctx.step))

    def observe(self, event):
        self.log.append(("observe", event.layer))

    def end_sequence(self, seq_id):
        self.log.append(("end", seq_id))

    def predict(self, layer_now, horizon_layers):
        self.log.append(("predict", layer_now))
        return []


def test_policy_sees_the_documented_call_order():
    topo = tiny.topology()
    trace = tiny.trace([[[[0], [1]]], [[[2], [3]]]], topo)
    log = []
    policy = POLICIES.create("lru", topo)
    policy.predictor = Spy(topo, log)
    run(policy, trace, cache_ratio=0.5, cost=tiny.cost())
    one = [("predict", -1), ("observe", 0), ("predict", 0), ("observe", 1), ("predict", 1)]
    assert log == [("begin", 0), *one, ("end", 0), ("begin", 1), *one, ("end", 1)]


@pytest.fixture(scope="module")
def synthetic():
    topo = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=tiny.MB)
    return synthetic_trace(topo, num_sequences=5, tokens_per_sequence=9, seed=4)


def _distinct(trace, groups):
    return sum(len(np.unique(trace.experts[rows, layer])) for rows in groups for layer in range(3))


def test_modes_count_iterations_and_distinct_experts(synthetic):
    bounds = synthetic.sequence_bounds()
    prefill_groups = [np.arange(s, e) for _, s, e in bounds]
    batched_groups = [rows for rows, _ in batched_rows(synthetic, 2)]
    expected = {
        "decode": (synthetic.num_tokens, synthetic.num_tokens * 3 * 2),
        "prefill": (len(bounds), _distinct(synthetic, prefill_groups)),
        "batched": (len(batched_groups), _distinct(synthetic, batched_groups)),
    }
    used = len({(layer, int(e)) for layer in range(3) for e in np.unique(synthetic.experts[:, layer])})
    for mode, (iterations, accesses) in expected.items():
        m = run(POLICIES.create("lru", synthetic.topology), synthetic, cache_ratio=1.0, mode=mode, batch_size=2, cost=tiny.cost())
        assert (m["num_iterations"], m["accesses"], m["num_tokens"]) == (iterations, accesses, synthetic.num_tokens)
        assert m["hits"] == m["accesses"] - used  # every expert is loaded once, then stays


def test_prefill_compute_grows_with_tokens_and_experts(synthetic):
    base = tiny.cost()
    cost = base.with_overrides(token_compute_ms=0.1, expert_compute_ms=0.5)
    m = run(POLICIES.create("lru", synthetic.topology), synthetic, cache_ratio=1.0, mode="prefill", cost=cost)
    expected = sum(
        cost.compute_ms(e - s, len(np.unique(synthetic.experts[s:e, layer])), 2)
        for _, s, e in synthetic.sequence_bounds()
        for layer in range(3)
    )
    assert m["resident_ms"] == pytest.approx(expected)


def test_a_layer_needing_more_experts_than_slots_is_a_budget_error(synthetic):
    with pytest.raises(BudgetError, match="raise the cache ratio"):
        run(POLICIES.create("lru", synthetic.topology), synthetic, cache_ratio=0.05, mode="prefill", cost=tiny.cost())


def test_partial_host_tier_reads_misses_from_disk(synthetic):
    full = run(POLICIES.create("lru", synthetic.topology), synthetic, cache_ratio=0.25, cost=tiny.cost())
    part = run(POLICIES.create("lru", synthetic.topology), synthetic, cache_ratio=0.25, host_cache_ratio=0.5, cost=tiny.cost())
    assert full["tier_hit_rate"]["host"] == 1.0 and 0.0 < part["tier_hit_rate"]["host"] < 1.0
    assert part["hit_rate"] == full["hit_rate"]  # no prefetch: the device tier sees the same misses
    assert part["stall_ms"] > full["stall_ms"] and part["bytes_by_link"]["disk_to_host"] > 0


def test_bounds_order_on_real_routing(deepseek_dev_path):
    from moestream.trace.format import load_trace

    trace = load_trace(deepseek_dev_path)
    sample = trace.select(trace.sequence_ids()[:12])
    config = SimConfig(cache_ratio=0.10)  # pcie4-consumer
    m = {name: simulate(POLICIES.create(name, trace.topology), sample, config) for name in ("lru", "belady", "oracle")}
    assert m["belady"]["hit_rate"] > m["lru"]["hit_rate"]
    assert m["oracle"]["stall_ms_per_token"] < m["lru"]["stall_ms_per_token"]
    assert m["lru"]["tpot_ratio_vs_resident"] > 1.0


class Unsure(tiny.ScriptedPredictor):
    """The scripted predictions, each with probability 0.2."""

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        return [p._replace(score=0.2) for p in super().predict(layer_now, horizon_layers)]


def test_on_a_saturated_link_unlikely_speculation_that_cannot_land_in_time_is_dropped_and_delays_no_demand():
    """Every layer misses and its 1 ms demand load leaves 0.5 ms of compute: a prefetch of the next layer
    cannot land in time. Planned blind, each (wrong) one starts and the next layer's demand load waits
    behind it; the bandwidth-aware planner weighs each (p 0.2: it would save 0.2 x 0.5 ms, and delay the
    layer's other loads 0.8 x 0.55 x 0.5 ms) and drops it, and no demand load waits for speculation."""
    topo = tiny.topology(num_layers=3)
    trace = tiny.trace([[[[0], [1], [2]], [[3], [2], [1]]]], topo)
    wrong = {1: [3], 2: [0]}  # never the expert the layer routes to

    def policy(planner):
        made = tiny.scripted(topo, wrong)
        made.predictor = Unsure(topo, wrong)
        made.planner = planner
        return made

    cost = tiny.cost(compute_ms=0.5)
    blind = run(policy(ScorePlanner()), trace, cache_ratio=0.5, cost=cost, horizon_layers=1)
    aware = run(policy(BandwidthAwarePlanner(0.0, 0.0)), trace, cache_ratio=0.5, cost=cost, horizon_layers=1)
    assert blind["prefetches"] > 0 and aware["prefetches"] == 0
    assert aware["stall_ms"] == pytest.approx(6 * 1.0)  # six demand loads, none behind a prefetch
    assert blind["stall_ms"] > aware["stall_ms"]
    assert aware["hit_rate"] == blind["hit_rate"] == 0.0


class Recording(ScorePlanner):
    """Plans as ScorePlanner does and keeps the link each view showed."""

    def __init__(self):
        super().__init__()
        self.links = []

    def plan(self, predictions, view):
        self.links.append(view.link)
        return super().plan(predictions, view)


@pytest.mark.parametrize("modelled_link", [True, False])
def test_the_planner_sees_the_modelled_link_only_where_the_config_asks(modelled_link):
    topo = tiny.topology()
    trace = tiny.trace([[[[0], [1]], [[0], [1]]]], topo)
    policy = tiny.scripted(topo, {1: [2]})
    policy.planner = Recording()
    run(policy, trace, cache_ratio=0.5, cost=tiny.cost(compute_ms=2.0), horizon_layers=1, modelled_link=modelled_link)
    assert policy.planner.links  # the planner was asked
    assert all((link is not None) == modelled_link for link in policy.planner.links)


def test_the_planner_sees_the_engines_link_figures_where_given():
    """bench fidelity's engine ran with --link-gbps and --layer-ms: the simulator's planner sees that link,
    not the cost model's."""
    from moestream.link_model import LinkFigures

    topo = tiny.topology()
    trace = tiny.trace([[[[0], [1]], [[0], [1]]]], topo)
    seen = {}
    for figures in (None, LinkFigures(gbps=3.0, layer_ms=4.0)):
        policy = tiny.scripted(topo, {1: [2]})
        policy.planner = Recording()
        run(policy, trace, cache_ratio=0.5, cost=tiny.cost(compute_ms=2.0), horizon_layers=1, link_figures=figures)
        seen[figures] = policy.planner.links[-1]
    assert (seen[None].bytes_per_ms, seen[None].layer_ms) != (3.0e6, 4.0)
    given = seen[LinkFigures(gbps=3.0, layer_ms=4.0)]
    assert (given.bytes_per_ms, given.layer_ms) == (3.0e6, 4.0)


def test_the_planners_link_ends_a_layer_when_the_simulator_does_where_experts_compute_as_they_land():
    """With routed_expert_ms a layer computes its experts as they land, waits what that leaves, then its
    whole compute: its two demand loads are one round that lands at 2 ms, so it waits 2 ms and ends at
    4 ms, its whole compute after the round. The planner's link says so."""
    topo = tiny.topology(top_k=2)
    trace = tiny.trace([[[[0, 1], [2, 3]]]], topo)
    policy = tiny.scripted(topo, {1: [2]})
    policy.planner = Recording()
    cost = tiny.cost(compute_ms=2.0).with_overrides(routed_expert_ms=0.5)
    m = run(policy, trace, cache_ratio=0.5, cost=cost, horizon_layers=1)
    assert policy.planner.links[0].next_need_ms == pytest.approx(2.0 + 2.0)
    # layer 1: (1, 2), prefetched 2..3 ms, computes 4..4.5 ms; (1, 3), read on demand from 4 ms, lands at 5 ms
    assert m["stall_ms"] == pytest.approx(2.0 + 0.5)


def test_a_speculative_read_that_finds_the_host_tier_full_is_refused_as_the_store_refuses_it():
    """One host slot, pinned by layer 0's demand read while it moves: the plan's two prefetches of layer 1
    find no free host slot and are refused (they leave the device tier, as `LinkChain.enqueue` does in the
    engine), where a simulator with a host tier of its own had them wait and retry."""
    topo = tiny.topology()
    trace = tiny.trace([[[[0], [1]]]], topo)
    policy = tiny.scripted(topo, {1: [1, 2]})
    m = run(policy, trace, cache_ratio=0.5, host_slots=1, cost=tiny.cost(compute_ms=2.0), horizon_layers=1)
    assert (m["prefetches"], m["prefetches_dropped"], m["hits"], m["demand_fetches"]) == (0, 2, 0, 2)
    assert m["bytes_by_link"] == {"disk_to_host": 2 * tiny.MB, "host_to_device": 2 * tiny.MB}
    roomy = run(tiny.scripted(topo, {1: [1, 2]}), trace, cache_ratio=0.5, host_slots=3, cost=tiny.cost(compute_ms=2.0),
                horizon_layers=1)
    assert (roomy["prefetches"], roomy["prefetches_dropped"], roomy["hits"]) == (2, 0, 1)


@pytest.mark.parametrize("sync", [False, True])
def test_a_demand_that_waits_for_a_host_slot_moves_what_is_queued_to_free_one(sync):
    """Two host slots for a layer's four misses: the third demand read waits for a slot, and the wait moves
    the reads and copies queued before it (as the engine's executors do) instead of finding nothing under way."""
    topo = tiny.topology(num_layers=2, num_experts=8, top_k=4)
    trace = tiny.trace([[[[0, 1, 2, 3], [4, 5, 6, 7]]]], topo)
    m = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, host_slots=2, sync=sync, cost=tiny.cost())
    assert (m["hits"], m["demand_fetches"]) == (0, 8)
    assert m["bytes_by_link"] == {"disk_to_host": 8 * tiny.MB, "host_to_device": 8 * tiny.MB}
    assert m["stall_ms"] >= 2 * (4 + 1)  # each layer: four reads, then at least its last copy, one after another
