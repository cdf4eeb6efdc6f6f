"""`moestream bench quant` end to end on a tiny model and its int4 copy: one line of figures per
checkpoint and policy at the same byte budget, and the ratios against the first. Figures are the
benchmark's business; the test checks what they count."""

import json

import pytest

from moestream.checkpoint.index import build_index
from moestream.checkpoint.quantize import quantize_checkpoint
from moestream.cli import main
from moestream.quant.encode import IntScheme


@pytest.fixture(scope="module")
def bench(tiny_checkpoint, tmp_path_factory):
    source = tiny_checkpoint("mixtral", num_layers=2, dtype="bf16")
    root = tmp_path_factory.mktemp("bench_quant")
    int4 = quantize_checkpoint(source, root / "int4", IntScheme(4, 32))
    out = root / "bench.json"
    code = main(["bench", "quant", "--models", f"{source},{int4}", "--policy", "lru", "--budget", "0.25",
                 "--max-new-tokens", "3", "--buffered-io", "--json", str(out)])
    return code, json.loads(out.read_text()), source, int4


def test_every_checkpoint_and_policy_runs_at_the_same_byte_budget(bench, capsys):
    code, rows, source, int4 = bench
    assert code == 0
    assert [(row["model"], row["sync"]) for row in rows] == [(str(source), False), (str(source), True),
                                                            (str(int4), False), (str(int4), True)]
    assert len({row["budget"] for row in rows}) == 1
    dense, packed = (build_index(path).topology.expert_bytes for path in (source, int4))
    assert [row["expert_bytes"] for row in rows] == [dense, dense, packed, packed]
    for row in rows:
        assert row["bytes_per_token"] == pytest.approx(row["expert_bytes"] * row["expert_misses"]
                                                       / row["decode_tokens"])
        assert row["mlp_ms"] > 0 and (row["decode_ms"] > 0) == (row["model"] == str(int4))


def test_the_quantized_checkpoint_holds_more_experts_in_the_budget(bench):
    _, rows, _, _ = bench
    assert rows[2]["hit_rate"] > rows[0]["hit_rate"] and rows[3]["hit_rate"] > rows[1]["hit_rate"]


def test_gpt_oss_experts_are_timed_with_the_familys_weight_layout(tiny_checkpoint, tmp_path):
    """GPT-OSS stores expert weights [in, out]: the MLP beside the decode is the family's own math."""
    model = tiny_checkpoint("gpt_oss", num_layers=2, quant="mxfp4")
    out = tmp_path / "bench.json"
    code = main(["bench", "quant", "--models", str(model), "--policy", "lru", "--max-new-tokens", "2",
                 "--buffered-io", "--threads", "1", "--device", "cpu", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert code == 0 and len(rows) == 2
    assert all(row["decode_ms"] > 0 and row["mlp_ms"] > 0 for row in rows)
    assert {(row["device"], row["threads"]) for row in rows} == {("cpu", 1)}


@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--threads", "0"]])
def test_a_device_without_cuda_or_no_threads_is_refused_in_one_line(tiny_checkpoint, capsys, flags):
    import torch

    if flags[0] == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model = tiny_checkpoint("mixtral", num_layers=2, dtype="bf16")
    assert main(["bench", "quant", "--models", str(model), *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and flags[0] in error


def test_the_default_policy_without_a_predictor_is_refused_before_any_run(tiny_checkpoint, capsys):
    """`default` (the policy here unless --policy says otherwise) needs a trained predictor: without a
    --predictor-dir of its kind the bench says so in one line and exits 2, before measuring anything."""
    model = tiny_checkpoint("mixtral", num_layers=2, dtype="bf16")
    assert main(["bench", "quant", "--models", str(model), "--max-new-tokens", "2", "--buffered-io"]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("moestream: error: ")
    assert "--policy default" in error and "--predictor-dir" in error and "train-predictor" in error
    assert captured.out == ""  # no run printed its figures
    assert main(["bench", "quant", "--models", str(model), "--predictor-dir", str(model)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("moestream: error: --predictor-dir: ")


def test_the_help_says_the_default_policy_needs_a_predictor(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "quant", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--policy default (the policy run here unless --policy names another) needs a trained predictor" in help_text
    assert "(the `default` policy needs one)" in help_text  # beside --predictor-dir
