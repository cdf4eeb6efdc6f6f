"""`moestream bench fidelity --small`: the engine and the simulator replay the same rows."""

import json

import pytest

from moestream.bench.fidelity import HIT_RATE_TOLERANCE, STALL_TOLERANCE, agreement
from moestream.checkpoint.index import build_index
from moestream.cli import main
from moestream.trace.format import save_trace
from tests.synthetic import synthetic_trace


@pytest.fixture
def small_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    from moestream.cli.demo import demo_checkpoint

    topology = build_index(demo_checkpoint(small=True)).topology
    trace = tmp_path / "trace.npz"
    save_trace(synthetic_trace(topology, num_sequences=2, tokens_per_sequence=12, seed=4), trace)
    return trace


def fidelity(trace, out, *flags):
    assert main(["bench", "fidelity", "--small", "--replay-routing", str(trace), "--budget", "0.5",
                 "--max-new-tokens", "4", "--buffered-io", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_on_demand_lru_agrees_when_calibrated_on_itself(small_trace, tmp_path, capsys):
    record = fidelity(small_trace, tmp_path / "fidelity.json", "--sync")
    engine, sim = record["engine"], record["simulator"]
    assert engine["decode_tokens"] == sim["decode_tokens"] > 0
    assert 0 < engine["hit_rate"] < 1 and engine["stall_ms_per_token"] > 0
    # the same LRU over the same rows and slots: the same hits and bytes; the costs are this run's own
    assert sim["hit_rate"] == pytest.approx(engine["hit_rate"])
    assert sim["bytes_per_token"] == pytest.approx(engine["bytes_per_token"])
    assert sim["stall_ms_per_token"] == pytest.approx(engine["stall_ms_per_token"], rel=0.01)
    assert engine["routed_expert_ms"] > 0 and record["cost_model"]["routed_expert_ms"] == engine["routed_expert_ms"]
    assert engine["peak_rss_mib"] > 0
    if engine["read_batch_line_ms"] is not None:  # a line through the batches: it is the reads' cost model
        assert record["cost_model"]["demand_batch_ms"] == pytest.approx(engine["read_batch_line_ms"][0])
    assert record["agreement"] | {"hit_rate_gap": 0, "stall_gap": 0} == {
        "hit_rate": "ok", "stall": "ok", "hit_rate_gap": 0, "stall_gap": 0}
    printed = capsys.readouterr().out
    assert "replayed routing" in printed and "hit rate" in printed and "peak RSS MiB" in printed


@pytest.mark.slow
def test_the_async_path_under_a_given_calibration(small_trace, tmp_path):
    """The asynchronous engine (cache-aware reordering) against the simulator's "ready" order, under a cost
    model read from an earlier run's JSON (--cost-model measured:PATH), not measured on the compared run."""
    first = tmp_path / "sync.json"
    calibration = fidelity(small_trace, first, "--sync")["cost_model"]
    record = fidelity(small_trace, tmp_path / "async.json", "--cost-model", f"measured:{first}")
    engine, sim = record["engine"], record["simulator"]
    assert record["mode"] == "async" and record["reorder"]
    assert numbers(record["cost_model"]) == numbers(calibration)
    assert engine["decode_tokens"] == sim["decode_tokens"] > 0
    assert abs(sim["hit_rate"] - engine["hit_rate"]) <= HIT_RATE_TOLERANCE  # LRU decides the same hits
    assert record["agreement"]["hit_rate"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fmoe", "promoe-routing"])
def test_predicting_designs_get_the_same_hit_rate_on_both_sides(policy, small_trace, tmp_path):
    """The engine hands the simulator what its policy saw (fmoe matches the embeddings) and runs the predictor
    inline as the simulator does (both designs predict on a worker thread elsewhere): the same decisions, so
    the same hit rate to the last digit, whatever the clocks and the cost model."""
    flags = ["--policy", policy, "--cost-model", "pcie4-consumer"]
    if policy == "promoe-routing":
        trained = tmp_path / "predictor"
        assert main(["train-predictor", "--kind", policy, "--trace", str(small_trace), "--out", str(trained),
                     "--epochs", "1", "--no-progress"]) == 0
        flags += ["--predictor-dir", str(trained)]
    record = fidelity(small_trace, tmp_path / "fidelity.json", *flags)
    engine, sim = record["engine"], record["simulator"]
    assert engine["decode_tokens"] == sim["decode_tokens"] > 0
    assert 0 < engine["hit_rate"] < 1
    assert sim["hit_rate"] == engine["hit_rate"]
    assert record["agreement"]["hit_rate_gap"] == 0


def test_a_calibration_whose_stall_is_mostly_one_slow_generation_keeps_a_positive_compute():
    """On a loaded machine one generation's reads can take most of a run's stall (a disk shared with other
    jobs): then the median generation's TPOT lies below the mean stall per token, and TPOT less stall was
    negative ("a measured cost model needs a positive decode time"). The compute comes from the same tokens
    as the stall."""
    from moestream.bench.engine.plan import calibrate
    from moestream.bench.engine.spec import Counters, summarize
    from moestream.topology import Topology

    steps = [[1000.0] * 3, [20.0] * 3, [20.0] * 3, [500.0] * 3]  # four generations' decode steps (ms)
    stall_ms = 3 * (990.0 + 10.0 + 10.0 + 490.0)  # every step computes for 10 ms, the rest is reads
    counters = Counters(disk_reads=12, read_ms=stall_ms, read_batches=12, decode_tokens=12,
                        tpot_ms=[generation[0] for generation in steps], step_ms=steps)
    run = summarize(counters, stall_ms, stall_ms)
    assert run["tpot_ms"] < run["stall_ms_per_token"]  # the median generation against the mean token
    topology = Topology(moe_layer_ids=(1, 2), num_experts=16, top_k=6, expert_bytes=24576)
    assert calibrate(topology, run).layer_compute_ms == pytest.approx(10.0 / 2)


def numbers(cost_model: dict) -> dict:
    return {k: v for k, v in cost_model.items() if not isinstance(v, str)}  # its name says where it came from


@pytest.mark.parametrize("hit_gap, hit", [(0.0, "ok"), (HIT_RATE_TOLERANCE - 0.001, "ok"),
                                          (-HIT_RATE_TOLERANCE + 0.001, "ok"), (HIT_RATE_TOLERANCE + 0.001, "missed"),
                                          (-HIT_RATE_TOLERANCE - 0.001, "missed")])
def test_hit_rates_agree_within_the_tolerance(hit_gap, hit):
    result = agreement({"hit_rate": 0.5, "stall_ms_per_token": 10.0},
                       {"hit_rate": 0.5 + hit_gap, "stall_ms_per_token": 10.0})
    assert result["hit_rate"] == hit and result["hit_rate_gap"] == pytest.approx(hit_gap)


@pytest.mark.parametrize("sim_stall, stall", [(10.0 * (1 + STALL_TOLERANCE - 0.01), "ok"),
                                              (10.0 * (1 - STALL_TOLERANCE + 0.01), "ok"),
                                              (10.0 * (1 + STALL_TOLERANCE + 0.01), "missed"),
                                              (10.0 * (1 - STALL_TOLERANCE - 0.01), "missed")])
def test_stalls_agree_within_the_tolerance(sim_stall, stall):
    engine = {"hit_rate": 0.5, "stall_ms_per_token": 10.0}
    result = agreement(engine, engine | {"stall_ms_per_token": sim_stall})
    assert result["stall"] == stall and result["stall_gap"] == pytest.approx(sim_stall / 10.0 - 1)


def test_an_engine_without_stall_agrees_only_with_a_simulator_without_stall():
    assert agreement({"hit_rate": 1.0, "stall_ms_per_token": 0.0}, {"hit_rate": 1.0, "stall_ms_per_token": 0.0})[
        "stall"] == "ok"
    result = agreement({"hit_rate": 1.0, "stall_ms_per_token": 0.0}, {"hit_rate": 1.0, "stall_ms_per_token": 0.5})
    assert result["stall"] == "missed" and result["stall_gap"] is None


def test_a_fidelity_run_without_enough_tokens_is_a_user_error(tmp_path):
    assert main(["bench", "fidelity", "--replay-routing", str(tmp_path / "t.npz"), "--max-new-tokens", "1"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("rule, mode", [("share:0.5", "--sync"), ("default", "--no-reorder")])
def test_host_compute_is_placed_as_the_engine_placed_it(small_trace, tmp_path, capsys, rule, mode):
    """Every expert in a host tier, the misses the rule names computed there: the simulator, given the engine's
    measured host compute costs and its warm device tier, names the same experts at every layer step."""
    record = fidelity(small_trace, tmp_path / "host.json", "--host-compute", rule, mode)
    placed = record["placements"]
    assert placed["host_experts"] > 0 and placed["layer_steps"] > 0
    assert placed["same"] == placed["layer_steps"] and placed["agree"] == "ok"
    assert record["agreement"]["hit_rate_gap"] == pytest.approx(0.0)
    assert "layer steps placed as the engine did" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "fmoe"])
def test_a_host_tier_runs_the_stores_mechanism_on_both_sides(policy, small_trace, tmp_path):
    """--host-budget with --sync: the engine keeps a host tier apart (disk -> host -> device) and the simulator
    runs the same chain of links over a host tier of the engine's slots, filled as the engine's warm-up left
    it: the same hits, and the same bytes over both links."""
    record = fidelity(small_trace, tmp_path / "host.json", "--sync", "--host-budget", "0.5", "--policy", policy,
                      "--cost-model", "pcie4-consumer")
    engine, sim = record["engine"], record["simulator"]
    assert record["host_budget"] == "0.5" and engine["host_bytes_per_token"] > 0
    assert sim["hit_rate"] == engine["hit_rate"] and record["agreement"]["hit_rate_gap"] == 0
    assert sim["bytes_per_token"] == pytest.approx(engine["bytes_per_token"] + engine["host_bytes_per_token"])
