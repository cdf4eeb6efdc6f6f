"""`moestream bench policies`: tables, JSON, plots and one-line errors."""

import json

from moestream.cli import main
from moestream.topology import Topology
from moestream.trace.format import save_trace
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology((1, 2, 3), num_experts=8, top_k=2, expert_bytes=1 << 20)


def test_prints_writes_json_and_plots(tmp_path, capsys):
    trace = save_trace(synthetic_trace(TOPOLOGY, num_sequences=10, tokens_per_sequence=10, seed=3), tmp_path / "t.npz")
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    argv = ["bench", "policies", "--trace", str(trace), "--policies", "lru,oracle,token", "--cache-ratios", "0.25",
            "--cost-models", "pcie4-consumer,h100-pcie5", "--horizons", "1", "--workers", "1",
            "--json", str(out), "--plot-dir", str(plots)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "h100-pcie5" in printed and "F1" in printed and "expert reuse in the replayed tokens" in printed
    doc = json.loads(out.read_text())
    assert doc["train"]["num_tokens"] + doc["test"]["num_tokens"] == 100
    assert set(doc["replays"]["stream"]) == {"pcie4-consumer", "h100-pcie5"}
    assert set(doc["replays"]["stream"]["h100-pcie5"]["token"]) == {"0.25"}
    assert "1" in doc["prediction"]["token"] and doc["default_losses"] == []
    assert doc["reuse"]["num_accesses"] == doc["test"]["num_tokens"] * 3 * 2
    assert sorted(p.name for p in plots.iterdir()) == ["moe-beyond.png", "stream-h100-pcie5.png", "stream-pcie4-consumer.png"]


def test_bad_input_is_one_error_line(tmp_path, capsys):
    trace = save_trace(synthetic_trace(TOPOLOGY, num_sequences=4, seed=3), tmp_path / "t.npz")
    assert main(["bench", "policies", "--trace", str(trace), "--test-fraction", "1.5", "--policies", "lru"]) == 2
    err = capsys.readouterr().err
    assert "--test-fraction must lie in (0, 1)" in err and err.count("\n") == 1
    assert main(["bench", "policies", "--trace", str(trace), "--policies", "lru,nope"]) == 2
    assert "nope" in capsys.readouterr().err
