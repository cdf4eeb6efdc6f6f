"""`moestream make-model`: writes a checkpoint, and bad input is one error line with exit code 2."""

import pytest

from moestream.checkpoint.index import build_index
from moestream.cli import main


def test_writes_a_checkpoint_and_summarises_it(tmp_path, capsys):
    out = tmp_path / "olmoe"
    code = main(["make-model", "olmoe", "--out", str(out), "--num-layers", "2", "--num-experts", "4", "--top-k", "1",
                 "--hidden-size", "32", "--intermediate-size", "16", "--vocab-size", "300", "--dtype", "bf16",
                 "--max-shard-bytes", "20000"])
    assert code == 0
    topology = build_index(out).topology
    assert (topology.num_layers, topology.num_experts, topology.top_k) == (2, 4, 1)
    assert topology.expert_bytes == 3 * 32 * 16 * 2
    assert (out / "model.safetensors.index.json").is_file()
    assert f"wrote olmoe checkpoint to {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["make-model", "llama"], "model type 'llama' has no MoE experts in transformers"),
        (["make-model", "mixtral", "--top-k", "20"], "top-k 20 must be between 1 and num_experts"),
        (["make-model", "mixtral", "--vocab-size", "99999"], "larger than the packaged corpus"),
        (["make-model"], "needs a FAMILY or --preset"),
        (["make-model", "mixtral", "--preset", "deepseek-v2-lite"], "is a deepseek_v2 model, not mixtral"),
        (["make-model", "--preset", "deepseek-v2-lite", "--width-scale", "-1"], "width scale must be in"),
        (["make-model", "mixtral", "--workers", "0"], "--workers must be >= 1"),
        (["make-model", "mixtral", "--quant", "mxfp4"], "--quant mxfp4 is written for gpt_oss, not mixtral"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, argv, problem):
    out = tmp_path / "out"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moestream: error: ") and problem in err[0]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_writes_a_quantized_checkpoint(tmp_path, capsys):
    out = tmp_path / "gpt_oss"
    assert main(["make-model", "gpt_oss", "--quant", "mxfp4", "--num-layers", "2", "--out", str(out)]) == 0
    checkpoint = build_index(out)
    assert checkpoint.codec.registry_name == "mxfp4"
    assert f"wrote mxfp4 gpt_oss checkpoint to {out}" in capsys.readouterr().out
    assert checkpoint.topology.expert_bytes == 7296  # 4.25 bits per weight, float32 biases


def test_refuses_a_non_empty_output(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    assert main(["make-model", "mixtral", "--out", str(tmp_path)]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err


def test_a_preset_at_a_width_scale_with_flags_over_it(tmp_path, capsys):
    """DeepSeek-V2-Lite's topology and fields at a 64th of its hidden width, experts narrowed by a flag."""
    out = tmp_path / "lite"
    code = main(["make-model", "--preset", "deepseek-v2-lite", "--width-scale", "0.03125", "--intermediate-size", "16",
                 "--vocab-size", "2048", "--out", str(out)])
    assert code == 0
    checkpoint = build_index(out)
    topology = checkpoint.topology
    assert (topology.num_layers, topology.num_experts, topology.top_k, topology.num_shared_experts) == (26, 64, 6, 2)
    assert topology.expert_bytes == 3 * 64 * 16 * 2  # hidden 2048 / 32, bf16
    assert (checkpoint.config.kv_lora_rank, checkpoint.config.intermediate_size) == (16, 10944)
    assert "with its integrity manifest" in capsys.readouterr().out
