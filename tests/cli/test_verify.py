"""`moestream verify` and damaged checkpoints end to end: one-line errors, exit 2, nothing written."""

import pytest

from moestream.checkpoint.manifest import MANIFEST_FILE
from moestream.cli import main
from tests.checkpoint.damage import copy_checkpoint, nan_in_experts, scramble_experts

PROMPT = "The experts are"


@pytest.fixture
def model_dir(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("qwen2_moe", num_layers=2, max_shard_bytes=300_000)
    return copy_checkpoint(source, tmp_path / "model")


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("moestream:")]
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


def _generate(model_dir, out, *flags: str) -> int:
    return main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--buffered-io", "--json", str(out), *flags])


def test_verify_writes_the_manifest_and_prints_its_throughput(model_dir, capsys):
    assert main(["verify", "--model", str(model_dir)]) == 0
    captured = capsys.readouterr()
    assert "verified" in captured.out and "/s" in captured.out and "wrote the digests of" in captured.out
    assert "nothing to compare the shards with" in captured.err  # no published digest: the bytes as they are now
    assert (model_dir / MANIFEST_FILE).is_file()
    assert main(["verify", "--model", str(model_dir)]) == 0
    captured = capsys.readouterr()
    assert "matched the digests of" in captured.out and "nothing to compare" not in captured.err


@pytest.mark.parametrize("mode", [(), ("--sync",), ("--chunk-size", "1KiB")])
def test_damaged_expert_bytes_with_a_manifest_stop_generation(model_dir, tmp_path, capsys, mode):
    assert main(["verify", "--model", str(model_dir)]) == 0
    damaged = scramble_experts(model_dir, layer=0)
    (info, _), *_ = damaged
    capsys.readouterr()
    out = tmp_path / "run.json"
    assert _generate(model_dir, out, *mode) == 2
    line = _error_line(capsys)
    assert "damaged expert bytes" in line and f"shard {info.file.name}" in line and "MoE layer 0 expert" in line
    assert "tensor model.layers.0." in line and not out.exists()
    assert main(["verify", "--model", str(model_dir)]) == 2
    line = _error_line(capsys)
    assert "damaged expert bytes" in line and f"(and {len(damaged) - 1} more damaged experts)" in line


def test_damaged_expert_bytes_without_a_manifest_stop_at_the_layer(model_dir, tmp_path, capsys):
    scramble_experts(model_dir, layer=0)
    out = tmp_path / "run.json"
    assert _generate(model_dir, out) == 2
    line = _error_line(capsys)
    assert "non-finite values" in line and "MoE layer 0" in line and not out.exists()
    assert "download them again" in line  # verify alone would record the damaged bytes as the reference


def test_nan_in_an_expert_tensor_stops_generation_naming_the_layer(model_dir, tmp_path, capsys):
    nan_in_experts(model_dir, layer=1)
    assert _generate(model_dir, tmp_path / "run.json") == 2
    line = _error_line(capsys)
    assert "non-finite values" in line and "MoE layer 1" in line


def test_a_missing_checkpoint_is_refused(tmp_path, capsys):
    assert main(["verify", "--model", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in _error_line(capsys)


def test_progress_into_a_log_is_plain_lines_of_the_real_bytes(model_dir, capsys):
    """stderr not a terminal (pytest captures it): each progress line gives bytes out of the shards' total,
    from the first (no size-less '0.00B' line) to the last, at 100%."""
    from tqdm import tqdm

    total = tqdm.format_sizeof(sum(path.stat().st_size for path in model_dir.glob("*.safetensors")), divisor=1024)
    assert main(["verify", "--model", str(model_dir)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verify")]
    assert lines and "100%" in lines[-1]
    assert all("%|" in line and f"/{total} " in line for line in lines), lines


def test_a_checkpoint_refused_before_reading_draws_no_progress(model_dir, capsys):
    (model_dir / "config.json").write_text("{not json")
    assert main(["verify", "--model", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "verify:" not in err
