"""`moestream bench engine` measures every run it reports, on a small demo checkpoint."""

import json

from moestream.cli import main


def test_bench_engine_reports_every_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--small", "--budgets", "0.25,0.5", "--max-new-tokens", "3",
                 "--buffered-io", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    plain, resident, *offloaded = record["runs"]
    assert plain["tpot_ms"] > 0 and resident["tpot_ms"] > 0
    assert resident["expert_misses"] == 0
    assert [run["expert_budget"] for run in offloaded] == ["0.25", "0.5"]
    assert all(run["expert_misses"] > 0 and run["stream_bytes_per_s"] > 0 for run in offloaded)
    assert offloaded[0]["hit_rate"] <= offloaded[1]["hit_rate"]
    assert all(run["experts_per_read_batch"] >= 1 for run in offloaded)
    assert record["sequential_read_bytes_per_s"] > 0 and record["layer_pass_vs_sequential"] > 0
    assert set(record["targets"]) == {"stream_vs_sequential", "layer_pass_vs_sequential",
                                      "resident_tpot_vs_transformers"}
    assert record["resident_tpot_vs_transformers"] > 0
    printed = capsys.readouterr().out
    assert "sequential read" in printed and "layer pass" in printed


def test_bench_engine_refuses_a_bad_budget(tmp_path, capsys):
    assert main(["bench", "engine", "--model", str(tmp_path), "--budgets", "0.25,lots"]) == 2
    assert "lots" in capsys.readouterr().err
