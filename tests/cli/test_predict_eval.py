"""`moestream predict-eval`: results as JSON, and one-line errors for bad input."""

import json

import pytest

from moestream.cli import main
from moestream.topology import Topology
from moestream.trace.format import save_trace
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=2_000_000)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    trace = synthetic_trace(TOPOLOGY, num_sequences=12, tokens_per_sequence=10, seed=4)
    train, test = trace.split(0.25, seed=0)
    return save_trace(train, root / "train.npz"), save_trace(test, root / "test.npz"), save_trace(trace, root / "all.npz")


def test_writes_json_with_metrics(traces, tmp_path, capsys):
    train, test, _ = traces
    out = tmp_path / "res" / "eval.json"
    code = main(["predict-eval", "--train", str(train), "--test", str(test), "--predictor", "cooccur",
                 "--horizon-layers", "2", "--cost-model", "pcie4-consumer", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["predictor"] == "cooccur" and result["horizon_layers"] == 2
    assert len(result["per_layer_f1"]) == 3 and 0 <= result["f1"] <= 1
    assert result["cost_model"] == "pcie4-consumer" and result["transfer_ms"] > 0
    assert "F1" in capsys.readouterr().out


def test_prints_a_table_and_splits_one_trace(traces, tmp_path, capsys):
    _, _, everything = traces
    code = main(["predict-eval", "--train", str(everything), "--test-fraction", "0.25", "--predictor", "token",
                 "--json", str(tmp_path / "r.json")])
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["num_tokens"] == 30 and result["horizon_layers"] == 2  # the engine's default
    out = capsys.readouterr().out
    assert "{" not in out and "30 test tokens" in out and f"{result['f1']:.4f}" in out


def test_zeros_are_explained(traces, capsys):
    train, test, _ = traces
    assert main(["predict-eval", "--train", str(train), "--test", str(test), "--predictor", "lru",
                 "--horizon-layers", "0"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "lru predicts nothing" in out and "no prediction can land in time" in out
    assert main(["predict-eval", "--train", str(train), "--test", str(test), "--predictor", "cooccur",
                 "--horizon-layers", "3", "--cost-model", "pcie4-consumer"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "predicts nothing" not in out and "no prediction can land" not in out


def _fails(capsys, *args):
    code = main(["predict-eval", *args])
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_bad_inputs_fail_with_one_line(traces, tmp_path, capsys):
    train, test, _ = traces
    text = tmp_path / "text.npz"
    text.write_text("not a trace")
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(train.read_bytes()[:200])
    other = save_trace(synthetic_trace(Topology((1, 2), 8, 2, 10), 2, 3), tmp_path / "other.npz")
    common = ["--predictor", "cooccur"]
    assert "not an npz" in _fails(capsys, "--train", str(text), "--test", str(test), *common)
    assert "truncated" in _fails(capsys, "--train", str(train), "--test", str(truncated), *common)
    assert "not found" in _fails(capsys, "--train", str(tmp_path / "none.npz"), "--test", str(test), *common)
    assert "unknown policy 'nope'" in _fails(capsys, "--train", str(train), "--test", str(test), "--predictor", "nope")
    mismatch = _fails(capsys, "--train", str(other), "--test", str(test), *common)
    assert "different topologies: 2 MoE layers x 8 experts, top-2 vs" in mismatch and "Topology(" not in mismatch
    assert "horizon-layers" in _fails(capsys, "--train", str(train), "--test", str(test), *common, "--horizon-layers", "9")
    assert "cost model" in _fails(capsys, "--train", str(train), "--test", str(test), *common, "--cost-model", "abacus")
    assert "test-fraction" in _fails(capsys, "--train", str(train), "--test-fraction", "1.5", *common)
