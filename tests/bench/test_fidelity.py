"""`moestream bench fidelity --small`: the engine and the simulator replay the same rows."""

import json

import pytest

from moestream.checkpoint.index import build_index
from moestream.cli import main
from moestream.trace.format import save_trace
from tests.synthetic import synthetic_trace


@pytest.mark.slow
def test_on_demand_lru_agrees_when_calibrated_on_itself(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    from moestream.cli.demo import demo_checkpoint

    topology = build_index(demo_checkpoint(small=True)).topology
    trace, out = tmp_path / "trace.npz", tmp_path / "fidelity.json"
    save_trace(synthetic_trace(topology, num_sequences=2, tokens_per_sequence=12, seed=4), trace)
    assert main(["bench", "fidelity", "--small", "--replay-routing", str(trace), "--sync", "--budget", "0.5",
                 "--max-new-tokens", "4", "--buffered-io", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    engine, sim = record["engine"], record["simulator"]
    assert engine["decode_tokens"] == sim["decode_tokens"] > 0
    assert 0 < engine["hit_rate"] < 1 and engine["stall_ms_per_token"] > 0
    # the same LRU over the same rows and slots: the same hits and bytes; the costs are this run's own
    assert sim["hit_rate"] == pytest.approx(engine["hit_rate"])
    assert sim["bytes_per_token"] == pytest.approx(engine["bytes_per_token"])
    assert sim["stall_ms_per_token"] == pytest.approx(engine["stall_ms_per_token"], rel=0.01)
    assert engine["routed_expert_ms"] > 0 and record["cost_model"]["routed_expert_ms"] == engine["routed_expert_ms"]
    if engine["read_batch_line_ms"] is not None:  # a line through the batches: it is the reads' cost model
        assert record["cost_model"]["demand_batch_ms"] == pytest.approx(engine["read_batch_line_ms"][0])
    assert record["agreement"] | {"hit_rate_gap": 0, "stall_gap": 0} == {
        "hit_rate": "ok", "stall": "ok", "hit_rate_gap": 0, "stall_gap": 0}
    printed = capsys.readouterr().out
    assert "replayed routing" in printed and "hit rate" in printed and "stall ms/tok" in printed


def test_a_fidelity_run_without_enough_tokens_is_a_user_error(tmp_path):
    assert main(["bench", "fidelity", "--replay-routing", str(tmp_path / "t.npz"), "--max-new-tokens", "1"]) == 2
