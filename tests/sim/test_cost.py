"""Cost-model presets and the arithmetic of transfers and compute."""

import json

import pytest

from moestream.bench.sim.cost import DEFAULT_COST_MODEL, PRESETS, CostModel, get_cost_model
from moestream.errors import MoestreamError

EXPERT_BYTES = 3 * 2048 * 1408 * 2  # one DeepSeek-V2-Lite routed expert


def test_presets_exist_with_sources_and_the_default_is_consumer_pcie4():
    assert {"pcie4-consumer", "h100-pcie5", "local-disk"} <= set(PRESETS)
    assert DEFAULT_COST_MODEL == "pcie4-consumer"
    assert all(model.source for model in PRESETS.values())


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    model = get_cost_model("pcie4-consumer")
    assert model.transfer_ms(EXPERT_BYTES) == pytest.approx(0.01 + EXPERT_BYTES / 25e9 * 1e3)
    assert model.transfer_ms(EXPERT_BYTES, "disk_to_host") == pytest.approx(0.1 + EXPERT_BYTES / 3e9 * 1e3)


def test_local_disk_fills_ram_from_disk():
    model = get_cost_model("local-disk")
    assert model.device_link == "disk_to_host" and not model.host_holds_all
    assert model.transfer_ms(EXPERT_BYTES) == model.transfer_ms(EXPERT_BYTES, "disk_to_host")


def test_faster_hardware_moves_and_computes_faster():
    consumer, h100 = get_cost_model("pcie4-consumer"), get_cost_model("h100-pcie5")
    assert h100.transfer_ms(EXPERT_BYTES) < consumer.transfer_ms(EXPERT_BYTES)
    assert h100.layer_compute_ms < consumer.layer_compute_ms


def test_compute_grows_with_extra_tokens_and_experts():
    model = CostModel("m", layer_compute_ms=1.0, host_to_device_gbps=1, disk_to_host_gbps=1, expert_compute_ms=0.5, token_compute_ms=0.1)
    assert model.compute_ms(1, 6, 6) == 1.0
    assert model.compute_ms(11, 10, 6) == pytest.approx(1.0 + 4 * 0.5 + 10 * 0.1)


def test_overrides_replace_only_given_fields():
    model = get_cost_model("pcie4-consumer")
    changed = model.with_overrides(layer_compute_ms=1.5, host_to_device_gbps=None)
    assert changed.layer_compute_ms == 1.5 and changed.host_to_device_gbps == model.host_to_device_gbps


def test_bad_names_and_values_are_user_errors():
    with pytest.raises(MoestreamError, match="unknown cost model"):
        get_cost_model("abacus")
    with pytest.raises(MoestreamError, match="must be > 0"):
        get_cost_model("pcie4-consumer").with_overrides(host_to_device_gbps=0.0)
    with pytest.raises(MoestreamError, match="unknown link"):
        get_cost_model("pcie4-consumer").transfer_ms(1, "carrier_pigeon")


def test_a_measured_cost_model_reads_back_from_a_bench_document(tmp_path):
    from dataclasses import asdict

    from moestream.bench.sim.cost import measured_cost_model

    model = measured_cost_model(num_layers=4, decode_ms_per_token=20.0, expert_bytes=2_000_000, expert_read_ms=2.0,
                                source="test")
    assert model.layer_compute_ms == 5.0 and not model.host_holds_all
    assert model.transfer_ms(2_000_000) == pytest.approx(2.0)  # experts come from disk, 1 GB/s
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"runs": [], "cost_model": asdict(model)}))
    loaded = get_cost_model(f"measured:{path}")
    assert loaded.transfer_ms(2_000_000) == pytest.approx(2.0) and loaded.layer_compute_ms == 5.0
    assert loaded.name == f"measured:{path}"


def test_a_measured_cost_model_splits_the_mean_read_into_a_batch_cost_and_bandwidth():
    from moestream.bench.sim.cost import measured_cost_model

    # 2 MB experts at 2 GB/s take 1 ms each; a mean of 1.5 ms at 4 experts per batch leaves 2 ms per batch
    model = measured_cost_model(num_layers=4, decode_ms_per_token=20.0, expert_bytes=2_000_000, expert_read_ms=1.5,
                                source="test", experts_per_batch=4.0, disk_gbps=2.0)
    assert model.transfer_ms(2_000_000) == pytest.approx(1.0) and model.demand_batch_ms == pytest.approx(2.0)
    slower = measured_cost_model(4, 20.0, 2_000_000, 0.5, "test", experts_per_batch=4.0, disk_gbps=2.0)
    assert slower.transfer_ms(2_000_000) == pytest.approx(0.5) and slower.demand_batch_ms == 0.0


def test_a_fitted_read_line_and_the_routed_experts_compute_go_into_the_measured_cost_model():
    from moestream.bench.engine.plan import calibrate
    from moestream.topology import Topology

    topology = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=8, top_k=2, expert_bytes=2_000_000)
    run = {"tpot_ms": 30.0, "stall_ms_per_token": 10.0, "expert_read_ms": 1.5, "experts_per_read_batch": 4.0,
           "read_batch_line_ms": [0.4, 0.8], "routed_expert_ms": 0.2}
    model = calibrate(topology, run, disk_bw=2e9)  # the line wins over the disk's bandwidth
    assert model.demand_batch_ms == pytest.approx(0.4) and model.transfer_ms(2_000_000) == pytest.approx(0.8)
    assert model.routed_expert_ms == 0.2 and model.layer_compute_ms == pytest.approx(5.0)
    without = calibrate(topology, run | {"read_batch_line_ms": None, "routed_expert_ms": None}, disk_bw=2e9)
    assert without.demand_batch_ms == pytest.approx(2.0) and without.routed_expert_ms == 0.0


def test_a_measured_cost_model_that_is_missing_or_not_one_is_a_user_error(tmp_path):
    from moestream.bench.sim.cost import CostModelError

    with pytest.raises(CostModelError, match="cannot read"):
        get_cost_model(f"measured:{tmp_path / 'absent.json'}")
    (tmp_path / "other.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(CostModelError, match="no measured cost model"):
        get_cost_model(f"measured:{tmp_path / 'other.json'}")
