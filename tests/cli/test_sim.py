"""`moestream sim`: JSON shape, table, plot, and one-line errors for bad input."""

import json

import numpy as np
import pytest

from moestream.cli import main
from moestream.topology import Topology
from moestream.trace.format import save_trace
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=1 << 20)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    test = save_trace(synthetic_trace(TOPOLOGY, num_sequences=5, tokens_per_sequence=14, seed=1), root / "test.npz")
    train = save_trace(synthetic_trace(TOPOLOGY, num_sequences=5, tokens_per_sequence=14, seed=2), root / "train.npz")
    return test, train


def test_json_has_a_block_per_policy_with_the_contract_keys(traces, tmp_path, capsys):
    test, train = traces
    out = tmp_path / "r.json"
    rc = main(["sim", "--trace", str(test), "--train", str(train), "--policy", "lru,belady,oracle", "--cache-ratio", "0.25", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert list(doc["policies"]) == ["lru", "belady", "oracle"]
    for metrics in doc["policies"].values():
        assert 0.0 <= metrics["hit_rate"] <= 1.0
        for key in ("stall_ms_per_token", "tpot_ratio_vs_resident", "bytes_per_token", "wasted_prefetch_ratio", "late_prefetch_ratio"):
            assert metrics[key] >= 0.0
        assert len(metrics["per_layer_hit_rate"]) == 3
    assert doc["cost_model"]["name"] == "pcie4-consumer"
    assert "belady" in capsys.readouterr().out


def test_with_the_oracle_every_policy_s_bytes_are_weighed_against_its(traces, tmp_path, capsys):
    test, _ = traces
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(test), "--policy", "lru,oracle", "--cache-ratio", "0.25,0.5", "--json",
                 str(out)]) == 0
    policies = json.loads(out.read_text())["policies"]
    for ratio in ("0.25", "0.5"):
        lru, oracle = policies["lru"]["by_ratio"][ratio], policies["oracle"]["by_ratio"][ratio]
        assert lru["bytes_vs_oracle"] == pytest.approx(lru["bytes_per_token"] / oracle["bytes_per_token"])
        assert lru["bytes_vs_oracle"] >= 1.0 and oracle["bytes_vs_oracle"] == 1.0
    assert "/ oracle" in capsys.readouterr().out
    assert main(["sim", "--trace", str(test), "--policy", "lru", "--cache-ratio", "0.25", "--json", str(out)]) == 0
    assert "bytes_vs_oracle" not in json.loads(out.read_text())["policies"]["lru"]  # no oracle, no ratio


def test_several_ratios_protocols_modes_and_a_plot(traces, tmp_path):
    test, _ = traces
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["sim", "--trace", str(test), "--policy", "lru", "--cache-ratio", "25%,0.5", "--json", str(out), "--plot", str(png)]
    assert main(argv + ["--mode", "batched", "--batch-size", "3", "--cost-model", "h100-pcie5", "--link-gbps", "5"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]["lru"]["by_ratio"]) == {"0.25", "0.5"} and doc["mode"] == "batched"
    assert doc["cost_model"]["host_to_device_gbps"] == 5.0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(argv[:-2] + ["--protocol", "moe-beyond"]) == 0
    assert json.loads(out.read_text())["policies"]["lru"]["stall_ms_per_token"] is None


def test_a_routed_experts_compute_overlaps_its_loads_in_the_expert_order_asked(traces, tmp_path):
    test, _ = traces
    out = tmp_path / "r.json"
    argv = ["sim", "--trace", str(test), "--policy", "lru", "--cache-ratio", "0.25", "--json", str(out),
            "--cost-model", "local-disk", "--routed-expert-ms", "1.0"]
    stall = {}
    for order in ("loaded", "given", "ready"):
        assert main(argv + ["--expert-order", order]) == 0
        doc = json.loads(out.read_text())
        stall[order] = doc["policies"]["lru"]["stall_ms_per_token"]
    assert doc["cost_model"]["routed_expert_ms"] == 1.0
    assert stall["loaded"] > stall["given"] >= stall["ready"] > 0  # a layer computes what it holds while it waits


def _deepseek_like(path, experts, layer_ids):
    n = len(experts)
    np.savez(path, experts=experts, prompt_id=np.zeros(n, np.int32), token_pos=np.arange(n, dtype=np.int32), moe_layer_ids=layer_ids)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("policy", "unknown policy 'nope'"),
        ("ratio", "--cache-ratio must lie in (0, 1]"),
        ("not-a-ratio", "is not a ratio (0.25) or a percentage (25%)"),
        ("missing", "trace file not found"),
        ("truncated", "truncated"),
        ("shape", "layers"),
        ("train-topology", "differs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(case, message, traces, tmp_path, capsys):
    test, _ = traces
    args = {"trace": str(test), "policy": "lru", "ratio": "0.5", "train": None}
    if case == "policy":
        args["policy"] = "lru,nope"
    elif case == "ratio":
        args["ratio"] = "150%"
    elif case == "not-a-ratio":
        args["ratio"] = "half"
    elif case == "missing":
        args["trace"] = str(tmp_path / "none.npz")
    elif case == "truncated":
        (tmp_path / "cut.npz").write_bytes(test.read_bytes()[:400])
        args["trace"] = str(tmp_path / "cut.npz")
    elif case == "shape":
        experts = np.zeros((4, 3, 6), np.uint8)  # 3 layers of routing, 4 layer ids
        args["trace"] = str(_deepseek_like(tmp_path / "bad.npz", experts, np.arange(1, 5, dtype=np.int32)))
    else:
        experts = np.zeros((4, 2, 6), np.uint8)
        args["train"] = str(_deepseek_like(tmp_path / "other.npz", experts, np.arange(1, 3, dtype=np.int32)))
    argv = ["sim", "--trace", args["trace"], "--policy", args["policy"], "--cache-ratio", args["ratio"]]
    rc = main(argv + (["--train", args["train"]] if args["train"] else []))
    err = capsys.readouterr().err
    assert rc == 2 and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_trained_predictor_directory_is_used_instead_of_fitting(traces, tmp_path, capsys):
    test, train = traces
    out = tmp_path / "ef"
    assert main(["train-predictor", "--kind", "expertflow", "--trace", str(train), "--out", str(out), "--epochs", "1",
                 "--set", "model_dim=16", "--set", "num_heads=2", "--set", "window_tokens=4", "--no-progress"]) == 0
    argv = ["sim", "--trace", str(test), "--policy", "expertflow,lru", "--cache-ratio", "0.5", "--predictor-dir", str(out)]
    assert main(argv) == 0
    assert "runs unfitted" not in capsys.readouterr().err  # expertflow loaded its directory
    assert main(["sim", "--trace", str(test), "--policy", "lru,default", "--cache-ratio", "0.5",
                 "--predictor-dir", str(out)]) == 2  # a directory of another kind trains no default
    err = capsys.readouterr().err
    assert "default needs a trained predictor" in err and "sim lru" not in err
    (out / "predictor.json").write_text("{")
    assert main(argv) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_policy_that_needs_training_stops_the_run_before_any_policy_runs(traces, tmp_path, capsys):
    test, _ = traces
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(test), "--policy", "lru,expertflow", "--cache-ratio", "0.25",
                 "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "expertflow needs a trained predictor" in captured.err
    assert "--train TRACE" in captured.err and "--predictor-dir DIR" in captured.err
    assert not out.exists() and "sim lru" not in captured.err  # nothing ran


def test_max_tokens_replays_the_first_whole_sequences_only(traces, tmp_path, capsys):
    from moestream.trace.format import load_trace

    test, _ = traces
    out, full = tmp_path / "r.json", load_trace(test)
    first_end = next(iter(full.sequence_bounds()))[2]
    assert main(["sim", "--trace", str(test), "--policy", "lru", "--cache-ratio", "0.25", "--max-tokens", "1",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["num_tokens"] == first_end < full.num_tokens
    assert main(["sim", "--trace", str(test), "--policy", "lru", "--cache-ratio", "0.25", "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
