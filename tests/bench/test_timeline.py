"""`moestream bench timeline --small`: one decode token's spans, lane by lane."""

import json

import pytest

from moestream.bench.timeline import TIMELINE_LANES
from moestream.checkpoint.demo import demo_checkpoint
from moestream.cli import main


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_token_s_lanes_add_up_and_its_spans_lie_inside_it(tmp_path, monkeypatch, capsys, mode):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    out, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    flags = ["--sync"] if mode == "sync" else []
    assert main(["bench", "timeline", "--small", "--max-new-tokens", "4", "--budget", "0.25", "--buffered-io",
                 "--json", str(out), "--plot", str(png), *flags]) == 0
    record = json.loads(out.read_text())
    assert record["token"] == 2 and record["token_ms"] > 0  # the step before the last
    assert set(record["lanes"]) == set(TIMELINE_LANES)
    assert record["lanes"]["host compute"]["spans"] == 0  # no --host-compute
    lanes = record["lanes"]
    assert lanes["experts"]["spans"] > 0 and lanes["policy"]["spans"] > 0  # every MoE layer computes and decides
    assert lanes["layer"]["spans"] > 0  # and weights and scatters its experts' rows
    assert lanes["disk"]["spans"] > 0 and lanes["h2d"]["spans"] == 0  # a quarter of the experts: misses; one tier
    thread = sum(lanes[lane]["busy_ms"] for lane in ("experts", "layer", "policy", "wait", "dense"))
    assert thread + record["rest_of_compute_thread_ms"] == pytest.approx(record["token_ms"])
    config = json.loads((demo_checkpoint(small=True) / "config.json").read_text())
    dense = record["dense"]  # every layer's attention, the shared experts of each MoE layer, one head
    assert dense["attention"]["calls"] == config["num_hidden_layers"]
    assert dense["shared experts"]["calls"] == config["num_hidden_layers"] - config["first_k_dense_replace"]
    assert dense["dense mlp"]["calls"] == config["first_k_dense_replace"] and dense["head"]["calls"] == 1
    assert dense["head"]["weight_mb"] * 1e6 == config["vocab_size"] * config["hidden_size"] * 2  # bfloat16
    assert sum(role["busy_ms"] for role in dense.values()) == pytest.approx(lanes["dense"]["busy_ms"])
    assert all(role["gb_per_s"] > 0 for role in dense.values())
    assert all(0 <= s["begin_ms"] <= s["end_ms"] <= record["token_ms"] for s in record["spans"])
    assert 0 < record["compute_thread_cpu_ms"] <= record["token_ms"] * 1.05  # thread_time ticks coarser
    assert sum(s["lane"] == "experts" for s in record["spans"]) == lanes["experts"]["spans"]
    if mode == "sync":  # the compute thread reads its own misses: every read is waited for
        assert record["transfer_beside_wait_ms"]["disk"] == pytest.approx(lanes["disk"]["busy_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "decode token 2" in printed and "link: disk" in printed and "dense: attention" in printed


def test_experts_computed_on_the_host_are_a_lane_of_the_compute_thread(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    out = tmp_path / "timeline.json"
    assert main(["bench", "timeline", "--small", "--max-new-tokens", "4", "--budget", "0.25", "--buffered-io",
                 "--host-budget", "1.0", "--host-compute", "share:1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    lanes = record["lanes"]
    assert lanes["host compute"]["spans"] > 0 and lanes["host compute"]["busy_ms"] > 0  # a span per MoE layer
    assert lanes["disk"]["spans"] == 0 and lanes["h2d"]["spans"] == 0  # every miss computed where its bytes are
    thread = sum(lanes[lane]["busy_ms"] for lane in ("experts", "layer", "policy", "wait", "dense", "host compute"))
    assert thread + record["rest_of_compute_thread_ms"] == pytest.approx(record["token_ms"])
    assert sum(s["lane"] == "host compute" for s in record["spans"]) == lanes["host compute"]["spans"]
    assert "compute thread: host compute" in capsys.readouterr().out


def test_a_token_past_the_generation_is_a_user_error():
    assert main(["bench", "timeline", "--max-new-tokens", "4", "--token", "4"]) == 2
    assert main(["bench", "timeline", "--max-new-tokens", "2"]) == 2
