"""`moestream bench engine --streaming` measures every run it reports, on a small demo checkpoint."""

import json

from moestream.checkpoint.index import build_index
from moestream.cli import main


def test_bench_engine_streaming_reports_every_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--streaming", "--small", "--budgets", "0.25,0.5", "--max-new-tokens", "3",
                 "--buffered-io", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    offloaded = record["runs"]
    assert [run["expert_budget"] for run in offloaded] == ["0.25", "0.5"]
    assert all(run["expert_misses"] > 0 and run["stream_bytes_per_s"] > 0 for run in offloaded)
    assert all(run["tpot_ms"] > 0 and run["cpu_tpot_ms"] > 0 for run in offloaded)
    assert offloaded[0]["hit_rate"] <= offloaded[1]["hit_rate"]
    assert all(run["experts_per_read_batch"] >= 1 for run in offloaded)
    assert record["sequential_read_bytes_per_s"] > 0 and record["layer_pass_vs_sequential"] > 0
    assert record["on_demand_vs_sequential"] > 0
    assert set(record["targets"]) == {"serving_prefill_vs_sequential", "layer_pass_vs_sequential"}
    printed = capsys.readouterr().out
    assert "sequential read" in printed and "layer pass" in printed and "on demand" in printed
    assert "streaming while serving, prefill" in printed and "informational)" in printed


def test_bench_engine_streaming_streams_a_long_prefill_at_the_first_and_the_least_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--streaming", "--small", "--budgets", "0.5", "--max-new-tokens", "2",
                 "--repeats", "3", "--buffered-io", "--json", str(out)]) == 0
    topology = build_index(tmp_path / "demo-small").topology
    record = json.loads(out.read_text())
    first = record["serving_prefill"]
    assert first["expert_budget"] == "0.5" and first["device_slots"] == topology.total_experts // 2
    assert record["serving_prefill_vs_sequential"] == first["vs_sequential"] > 0
    prefill = record["least_budget_prefill"]
    assert prefill["device_slots"] == topology.top_k
    assert prefill["expert_budget"] == f"{topology.top_k * topology.expert_bytes}B"
    assert prefill["num_prompt_tokens"] > 100
    # some layer routes more experts than the tier holds: they stream through it within the layer
    assert topology.num_layers * topology.top_k < prefill["expert_misses"] <= topology.total_experts
    assert prefill["expert_hits"] == 0 and prefill["tpot_ms"] == 0
    assert prefill["bytes_read"]["disk"] == prefill["expert_misses"] * topology.expert_bytes
    assert 1 <= prefill["experts_per_read_batch"] <= topology.top_k
    assert 0 < prefill["wall_bytes_per_s"] <= prefill["stream_bytes_per_s"]
    rates, around = prefill["stream_samples_bytes_per_s"], prefill["sequential_around_bytes_per_s"]
    ratios = sorted(rate / reference for rate, reference in zip(rates, around))
    assert len(rates) == len(around) == 3
    assert record["least_budget_prefill_vs_sequential"] == prefill["vs_sequential"] == ratios[1]
    assert record["targets"]["serving_prefill_vs_sequential"] in ("ok", "missed")
    assert len(record["disk_samples_bytes_per_s"]["sequential"]) == 3 * 3  # before each prefill and the budget run
    assert first["expert_misses"] == prefill["expert_misses"]  # the same tokens route the same experts


def test_bench_engine_streaming_refuses_a_bad_budget_or_repeat_count(tmp_path, capsys):
    assert main(["bench", "engine", "--streaming", "--model", str(tmp_path), "--budgets", "0.25,lots"]) == 2
    assert "lots" in capsys.readouterr().err
    assert main(["bench", "engine", "--streaming", "--small", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_the_two_modes_are_refused_together(capsys):
    assert main(["bench", "engine", "--streaming", "--expert-parallel", "2"]) == 2
    assert "two modes" in capsys.readouterr().err
