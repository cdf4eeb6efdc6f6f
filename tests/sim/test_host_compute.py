"""Host compute in the stream simulator and `moestream sim --host-compute`: where each miss computes and
what that does to the stall (moestream.bench.sim.host_compute; the rules are moestream.policies.compute_placement)."""

import json
from dataclasses import replace

import pytest

from moestream.bench.sim import PRESETS, SimConfig, simulate
from moestream.bench.sim.host_compute import compute_costs
from moestream.cli import main
from moestream.errors import MoestreamError
from moestream.policies import POLICIES
from moestream.topology import Topology
from moestream.trace.format import save_trace
from tests.sim import tiny
from tests.synthetic import synthetic_trace

FIGURES = {"host_expert_gbps": 2.0, "host_tflops": 1.0, "device_expert_gbps": 100.0, "device_tflops": 10.0}
DSV2_EXPERT = 3 * 2048 * 1408 * 2  # DeepSeek-V2-Lite's routed expert in bf16 (17.3 MB)


def run(policy, trace, **config):
    return simulate(policy, trace, SimConfig(**config), "stream")


def tiny_cost(compute_ms: float = 0.2):
    """1 ms per 1 MB copy; the host streams an expert in 0.5 ms."""
    return replace(tiny.cost(compute_ms=compute_ms), **FIGURES)


def test_off_places_nothing_and_keeps_the_figures_the_core_gives():
    topo = tiny.topology()
    trace = tiny.trace([[[[0], [0]], [[0], [0]], [[1], [1]], [[0], [0]]]], topo)
    off = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, cost=tiny_cost(2.0))
    assert off["host_computed_misses"] == 0 and off["device_computed_misses"] == 4
    assert off["stall_ms_per_token"] == pytest.approx(1.0)  # as test_engine: four 1 ms demand loads
    # the rule's path (lookups, then admissions) with nothing placed gives the core's fetch_layer figures
    nothing = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, cost=tiny_cost(2.0), host_compute="share:0")
    assert nothing == off


@pytest.mark.parametrize("name", ["lru", "oracle"])
def test_off_and_placing_nothing_agree_on_a_synthetic_trace_with_prefetch_and_a_host_tier(name):
    topo = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=tiny.MB)
    trace = synthetic_trace(topo, num_sequences=3, tokens_per_sequence=16, seed=3)
    policy = POLICIES.create(name, topo)
    config = {"cache_ratio": 0.25, "host_cache_ratio": 0.5, "cost": tiny_cost(0.5)}
    off = run(policy, trace, **config)
    assert run(policy, trace, **config, host_compute="share:0") == off
    assert off["host_computed_misses"] == 0 and (name == "lru" or off["prefetches"] > 0)


def test_share_one_computes_every_miss_of_a_full_host_on_the_host_beside_the_device():
    topo = tiny.topology()
    trace = tiny.trace([[[[0], [0]], [[1], [1]]]], topo)  # four misses
    m = run(POLICIES.create("lru", topo), trace, cache_ratio=0.5, cost=tiny_cost(0.2), host_compute="share:1",
            hidden_bytes=1)
    assert (m["host_computed_misses"], m["device_computed_misses"], m["hits"]) == (4, 0, 0)
    assert m["bytes_by_link"]["host_to_device"] == 0 and m["demand_fetches"] == 0
    # each layer: the host's 0.5 ms streaming, 1e-3 ms arithmetic (2 x 0.5M params at 1 TFLOP/s) and its row
    # there and back (2 bytes), against the device's 0.2 ms
    assert m["stall_ms"] == pytest.approx(4 * (0.5 + 1e-3 + 2e-6 - 0.2))
    assert m["sim_ms"] == pytest.approx(m["resident_ms"] + m["stall_ms"])


def test_share_one_computes_misses_only_on_disk_on_the_host_which_reads_them_itself():
    """A host tier of half the experts: share:1 places every miss on the host, those not in the host tier
    read there by the host lane (DISK_CANDIDATES of them a layer, here all): nothing crosses either link,
    and the reads lengthen the host lane."""
    topo = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=tiny.MB)
    trace = synthetic_trace(topo, num_sequences=3, tokens_per_sequence=16, seed=3)
    config = {"cache_ratio": 0.25, "host_cache_ratio": 0.5, "host_compute": "share:1"}
    m = run(POLICIES.create("lru", topo), trace, cost=tiny_cost(), **config)
    assert m["host_computed_misses"] == m["accesses"] - m["hits"] > 0 and m["device_computed_misses"] == 0
    assert m["bytes_by_link"] == {"host_to_device": 0, "disk_to_host": 0}
    slower_disk = replace(tiny_cost(), disk_to_host_gbps=tiny_cost().disk_to_host_gbps / 4)
    assert run(POLICIES.create("lru", topo), trace, cost=slower_disk, **config)["stall_ms"] > m["stall_ms"]


def _dsv2_like(num_experts: int, top_k: int) -> Topology:
    return Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=num_experts, top_k=top_k, expert_bytes=DSV2_EXPERT)


def test_default_computes_decode_misses_on_the_host_with_the_pcie4_preset():
    """One token a step: an expert's one row costs the host 0.43 ms of streaming against 0.69 ms over the link."""
    topo = _dsv2_like(64, 6)
    trace = synthetic_trace(topo, num_sequences=4, tokens_per_sequence=24, seed=5)
    config = {"cache_ratio": 0.25, "cost": PRESETS["pcie4-consumer"], "hidden_bytes": 4096}
    off = run(POLICIES.create("lru", topo), trace, **config)
    m = run(POLICIES.create("lru", topo), trace, **config, host_compute="default")
    assert 0 < m["host_computed_misses"] and m["device_computed_misses"] > 0  # both lanes busy
    assert m["stall_ms_per_token"] < off["stall_ms_per_token"] / 1.3


def test_default_computes_nothing_on_the_host_at_prefill_sizes():
    """1,024-token prompts over 8 experts, top-6: 400 to 1,000 rows an expert cost the host 7 ms or more, more
    than the device's copies of a whole layer (8 x 0.69 ms); forced, the host makes the layer slower."""
    topo = _dsv2_like(8, 6)
    trace = synthetic_trace(topo, num_sequences=2, tokens_per_sequence=1024, seed=6)
    config = {"cache_ratio": 0.5, "cost": PRESETS["pcie4-consumer"], "mode": "prefill", "hidden_bytes": 4096}
    off = run(POLICIES.create("lru", topo), trace, **config)
    m = run(POLICIES.create("lru", topo), trace, **config, host_compute="default")
    assert m["host_computed_misses"] == 0 and m["stall_ms"] == off["stall_ms"]
    forced = run(POLICIES.create("lru", topo), trace, **config, host_compute="share:1")
    assert forced["host_computed_misses"] > 0 and forced["stall_ms"] > off["stall_ms"]


def test_gpu_presets_carry_host_compute_figures_and_the_rule_is_checked():
    topo = _dsv2_like(64, 6)
    for name in ("pcie4-consumer", "h100-pcie5", "h100-deepseek-v3"):
        costs = compute_costs(SimConfig(0.25, cost=PRESETS[name], host_compute="default"), topo)
        assert costs.host_ms(1) < costs.copy_ms() and costs.device_ms(1) < costs.host_ms(1)
    pcie4 = compute_costs(SimConfig(0.25, cost=PRESETS["pcie4-consumer"]), topo)
    assert pcie4.copy_ms() == pytest.approx(DSV2_EXPERT / 25e6) and pcie4.expert_params == DSV2_EXPERT // 2
    with pytest.raises(MoestreamError, match="--host-compute"):
        SimConfig(0.25, cost=PRESETS["local-disk"], host_compute="default")  # no host tier, no figures
    for bad in ("nope", "share:1.5", "share:x", "off:1"):
        with pytest.raises(MoestreamError, match="--host-compute"):
            SimConfig(0.25, host_compute=bad)


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    topo = Topology(moe_layer_ids=(1, 2, 3), num_experts=16, top_k=2, expert_bytes=DSV2_EXPERT)
    path = tmp_path_factory.mktemp("hc") / "t.npz"
    return save_trace(synthetic_trace(topo, num_sequences=3, tokens_per_sequence=16, seed=7), path)


def test_cli_prints_each_placement_and_the_saving_against_off(small_trace, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["sim", "--trace", str(small_trace), "--policy", "lru", "--cache-ratio", "0.25", "--json", str(out)]
    assert main(argv + ["--host-compute", "share:1"]) == 0
    doc = json.loads(out.read_text())
    saving = doc["policies"]["lru"]["host_compute"]
    assert doc["host_compute"] == "share:1" and saving["device_computed_misses"] == 0
    assert saving["host_computed_misses"] == doc["policies"]["lru"]["accesses"] - doc["policies"]["lru"]["hits"]
    assert saving["stall_saved_ms_per_token"] == pytest.approx(
        saving["off_stall_ms_per_token"] - doc["policies"]["lru"]["stall_ms_per_token"])
    table = capsys.readouterr().out
    assert "misses host/dev" in table and f"{saving['host_computed_misses']}/0" in table
    assert main(argv) == 0  # off: the table and figures of before
    assert "host_compute" not in json.loads(out.read_text())["policies"]["lru"]
    assert "misses host/dev" not in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--host-compute", "sometimes"], "--host-compute 'sometimes': unknown rule"),
    (["--host-compute", "share:2"], "--host-compute share:2.0: the share must be between 0 and 1"),
    (["--host-compute", "default", "--cost-model", "local-disk"], "--host-compute default: cost model 'local-disk'"),
    (["--host-compute", "default", "--protocol", "moe-beyond"], "--host-compute default needs --protocol stream"),
])
def test_cli_refuses_a_bad_rule_in_one_line(small_trace, capsys, flags, message):
    argv = ["sim", "--trace", str(small_trace), "--policy", "lru", "--cache-ratio", "0.25"]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
