"""Expert parallelism in the simulator: one rank is the single-process simulator figure for figure;
ranks split the accesses, prefetch only what they own, and pay the network per layer."""

import copy
import json

import pytest

from moestream.bench.sim import SimConfig, get_cost_model, simulate
from moestream.bench.sim.network import NETWORKS, NetworkLink, get_network
from moestream.bench.sim.ranks import RankSetup, simulate_ranks
from moestream.bench.sim.synthetic import shape_of
from moestream.cli import main
from moestream.parallel.placement import ActivationStats, make_placement
from moestream.policies import POLICIES
from moestream.topology import Topology
from moestream.trace.format import save_trace
from tests.sim import tiny
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=16, top_k=2, expert_bytes=1 << 20)
TRACE = synthetic_trace(TOPOLOGY, num_sequences=4, tokens_per_sequence=16, seed=3)
TRAIN = synthetic_trace(TOPOLOGY, num_sequences=4, tokens_per_sequence=16, seed=4)


def fitted(name: str):
    policy = POLICIES.create(name, TOPOLOGY)
    policy.fit(TRAIN)
    return policy


def ranked(policy, config: SimConfig, world: int, placement: str = "round-robin", network=None, trace=TRACE,
           hidden_bytes: int = 4096) -> dict:
    stats = ActivationStats.from_routing(trace.experts, trace.topology.num_experts)
    setup = RankSetup(make_placement(placement, trace.topology, world, stats), network, hidden_bytes)
    return simulate_ranks(copy.deepcopy(policy), trace, config, setup)


CONFIGS = {
    "decode": SimConfig(cache_ratio=0.25),
    "host tier": SimConfig(cache_ratio=0.2, host_cache_ratio=0.5, cost=get_cost_model("h100-pcie5")),
    "routed compute": SimConfig(cache_ratio=0.25, cost=get_cost_model("h100-deepseek-v3"), expert_order="given"),
    "batched": SimConfig(cache_ratio=0.3, mode="batched", batch_size=3),
    "disk": SimConfig(cache_ratio=0.25, cost=get_cost_model("local-disk")),
}


@pytest.mark.parametrize("policy", ["lru", "cooccur"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_one_rank_without_network_is_the_single_process_simulator_to_the_last_digit(policy, case):
    config, policy = CONFIGS[case], fitted(policy)
    single = simulate(copy.deepcopy(policy), TRACE, config)
    result = ranked(policy, config, 1)
    rank = result["ranks"][0]
    assert {key: rank[key] for key in single} == single
    for key in ("tpot_ms", "stall_ms_per_token", "hit_rate", "bytes_per_token"):
        assert result[key] == single[key], key
    assert result["resident_tpot_ms"] == single["resident_tpot_ms"]
    assert result["network_ms_per_token"] == 0.0


@pytest.mark.parametrize("placement", ["round-robin", "balanced"])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_split_the_accesses_and_each_owns_its_share(placement, world):
    config, policy = CONFIGS["decode"], fitted("lru")
    single = simulate(copy.deepcopy(policy), TRACE, config)
    result = ranked(policy, config, world, placement, get_network("100gbe"))
    ranks = result["ranks"]
    assert sum(r["accesses"] for r in ranks) == single["accesses"]  # a layer's experts are partitioned
    assert [r["experts_owned"] for r in ranks] == [TOPOLOGY.total_experts // world] * world
    assert all(r["num_tokens"] == TRACE.num_tokens for r in ranks)


def test_each_rank_prefetches_only_the_predicted_experts_it_owns():
    topo = tiny.topology(num_layers=2, num_experts=4, top_k=1)
    trace = tiny.trace([[[[0], [2]], [[1], [3]]]], topo)  # two tokens: layer 0, layer 1
    policy = tiny.scripted(topo, {1: [0, 1, 2]})  # after layer 0, experts 0, 1 and 2 of layer 1
    config = SimConfig(cache_ratio=1.0, cost=tiny.cost())
    single = simulate(copy.deepcopy(policy), trace, config)
    result = ranked(policy, config, 2, trace=trace)  # round-robin: rank 0 owns 0 and 2, rank 1 owns 1 and 3
    assert single["prefetches"] == 3
    assert [r["prefetches"] for r in result["ranks"]] == [2, 1]


def test_a_layer_waits_for_the_dispatch_the_remote_experts_and_the_combine():
    """Layer 0 routes to expert 1 (rank 1), layer 1 to expert 0 (rank 0); loads take 1 ms, messages
    1.5 ms (0.5 ms + 1 MB at 1 GB/s), rank 0's layer computes 2 ms, rank 1's routed rows nothing.
    Layer 0: rank 1 gets the token at 1.5, loads till 2.5, its combine lands at 4.0 (rank 0 done at
    2.0). Layer 1: rank 0 loads till 5.0 and computes till 7.0."""
    topo = tiny.topology(num_layers=2, num_experts=2, top_k=1)
    trace = tiny.trace([[[[1], [0]]]], topo)  # one token: expert 1 at layer 0, expert 0 at layer 1
    network = NetworkLink("test", gbps=1.0, latency_ms=0.5)
    placement = make_placement("round-robin", topo, 2)
    setup = RankSetup(placement, network, hidden_bytes=1_000_000)
    result = simulate_ranks(POLICIES.create("lru", topo), trace, SimConfig(cache_ratio=1.0, cost=tiny.cost()), setup)
    assert result["tpot_ms"] == 7.0
    assert result["network_ms_per_token"] == 3.0
    assert result["resident_tpot_ms"] == 5.0  # 3 ms of messages + 2 ms of compute
    assert result["critical_stall_ms_per_token"] == 2.0
    assert [r["network_bytes_per_token"] for r in result["ranks"]] == [0, 2_000_000]


def test_more_ranks_with_the_same_budget_each_hit_more_and_run_faster():
    config, policy = CONFIGS["decode"], fitted("lru")
    results = [ranked(policy, config, world, "balanced", get_network("nvlink")) for world in (1, 2, 4)]
    hit_rates = [r["hit_rate"] for r in results]
    assert hit_rates == sorted(hit_rates) and hit_rates[0] < hit_rates[-1]
    assert results[-1]["tpot_ms"] < results[0]["tpot_ms"]


def test_a_slower_network_costs_more_time_once_it_outlasts_rank_0s_compute():
    config, policy = CONFIGS["decode"], fitted("lru")
    small = [ranked(policy, config, 4, network=get_network(name)) for name in ("25gbe", "nvlink")]
    assert small[0]["network_ms_per_token"] > small[1]["network_ms_per_token"] > 0
    assert small[0]["tpot_ms"] == small[1]["tpot_ms"]  # 4 KB messages hide behind rank 0's dense part
    slow, fast = (ranked(policy, config, 4, network=get_network(name), hidden_bytes=1 << 20)
                  for name in ("25gbe", "nvlink"))
    assert slow["tpot_ms"] > fast["tpot_ms"]


def test_network_presets_are_named_and_sourced():
    assert {"25gbe", "100gbe", "400gbe", "nvlink"} <= set(NETWORKS)
    assert all(link.source for link in NETWORKS.values())
    assert get_network("none") is None


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return save_trace(TRACE, tmp_path_factory.mktemp("ranks") / "test.npz")


def test_cli_prints_the_scaling_and_writes_json_and_plot(trace_file, tmp_path, capsys):
    out, plot = tmp_path / "ranks.json", tmp_path / "ranks.png"
    argv = ["sim", "--trace", str(trace_file), "--policy", "lru", "--cache-ratio", "0.25", "--ranks", "1,2,4",
            "--network", "100gbe", "--expert-parallel-placement", "balanced", "--hidden-bytes", "4096", "--json", str(out),
            "--plot", str(plot)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "hit rate per rank" in table and "network ms/tok" in table
    doc = json.loads(out.read_text())
    by_ranks = doc["policies"]["lru"]["0.25"]
    assert sorted(by_ranks) == ["1", "2", "4"] and len(by_ranks["4"]["ranks"]) == 4
    assert doc["placement"] == "balanced" and plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("flags, message", [
    (["--ranks", "0"], "--ranks"),
    (["--ranks", "two"], "--ranks"),
    (["--ranks", "2", "--network", "10gbe"], "unknown network '10gbe'"),
    (["--ranks", "2", "--expert-parallel-placement", "striped"], "unknown placement 'striped'"),
    (["--ranks", "2", "--network", "100gbe"], "--hidden-bytes"),
    (["--ranks", "2", "--protocol", "moe-beyond"], "--protocol stream"),
])
def test_bad_rank_flags_are_one_line_and_exit_2(flags, message, trace_file, capsys):
    rc = main(["sim", "--trace", str(trace_file), "--policy", "lru", "--cache-ratio", "0.25", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_deepseek_v3_shape_and_an_unknown_synthetic_shape(capsys):
    topology = shape_of("synthetic:deepseek-v3").topology
    assert (topology.num_layers, topology.num_experts, topology.top_k) == (58, 256, 8)
    assert topology.expert_bytes == 3 * 7168 * 2048  # FP8, as the checkpoint ships
    assert main(["sim", "--trace", "synthetic:nope", "--policy", "lru", "--cache-ratio", "0.25"]) == 2
    err = capsys.readouterr().err
    assert "unknown synthetic model shape 'nope'" in err and err.count("\n") == 1
