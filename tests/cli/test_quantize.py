"""`moestream quantize` end to end, and quantized checkpoints at the CLI's edges: refused methods,
damaged shards caught by verify, bad input answered in one line with nothing written."""

import json
import shutil

import numpy as np
import pytest

from moestream.checkpoint.index import build_index
from moestream.cli import main
from tests.checkpoint.damage import overwrite


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    return tiny_checkpoint("mixtral", num_layers=2, dtype="bf16")


@pytest.fixture(scope="module")
def int4(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "model"
    assert main(["quantize", "--model", str(source), "--format", "int4", "--out", str(out), "--no-error"]) == 0
    return out


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("moestream")]
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


def _exit_code(argv) -> int:
    """main's exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def _generate(model, *flags) -> int:
    return main(["generate", "--model", str(model), "--prompt", "The experts are", "--max-new-tokens", "3",
                 "--buffered-io", *flags])


def test_quantize_writes_a_loadable_copy_and_prints_its_error(source, tmp_path, capsys):
    out = tmp_path / "int8"
    assert main(["quantize", "--model", str(source), "--format", "int8", "--out", str(out), "--error-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "int8 experts (one scale per row)" in printed and "fewer bytes than" in printed
    assert "top-1 agreement" in printed and "mean KL" in printed and "max abs logit error" in printed
    assert build_index(out).topology.expert_bytes < build_index(source).topology.expert_bytes / 1.9
    assert _generate(out) == 0
    assert main(["verify", "--model", str(out)]) == 0 and "matched the digests" in capsys.readouterr().out


def test_verify_and_generate_catch_a_damaged_quantized_shard(int4, tmp_path, capsys):
    model = shutil.copytree(int4, tmp_path / "model")
    location = build_index(model).experts.locations[(0, 1)]
    widest = max(location.segments, key=lambda s: s.nbytes)  # packed weights
    overwrite(widest.file, widest.offset, np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes())
    assert main(["verify", "--model", str(model)]) == 2
    assert "damaged expert bytes" in _error_line(capsys)
    assert _generate(model, "--expert-budget", "1.0") == 2
    line = _error_line(capsys)
    assert "damaged expert bytes" in line and "MoE layer 0 expert 1" in line


def test_an_unsupported_quantization_method_is_refused_at_open(int4, tmp_path, capsys):
    model = shutil.copytree(int4, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    assert _generate(model) == 2
    line = _error_line(capsys)
    assert "unsupported quantization method 'awq'" in line and "compressed-tensors" in line and "gptq" in line


@pytest.mark.parametrize("flags,words", [
    (["--format", "int4", "--group-size", "48"], "--group-size 48 does not divide"),
    (["--format", "int4", "--group-size", "0"], "--group-size must be >= 1"),
    (["--format", "int2"], "invalid choice: 'int2'"),
])
def test_bad_flags_are_one_line_exit_2_and_nothing_is_written(source, tmp_path, capsys, flags, words):
    out = tmp_path / "out"
    assert _exit_code(["quantize", "--model", str(source), "--out", str(out), *flags]) == 2
    assert words in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_bad_models_and_outputs_are_refused(source, int4, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["quantize", "--model", str(int4), "--format", "int8", "--out", str(out)]) == 2
    assert "is already quantized (compressed-tensors)" in _error_line(capsys)
    assert main(["quantize", "--model", str(tmp_path / "none"), "--format", "int8", "--out", str(out)]) == 2
    assert "does not exist" in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "x").write_text("")
    assert main(["quantize", "--model", str(source), "--format", "int8", "--out", str(out)]) == 2
    assert "--out" in _error_line(capsys) and [p.name for p in tmp_path.iterdir()] == ["out"]
