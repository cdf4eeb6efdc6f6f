"""Settings are declared once: the commands' flags are generated from the config dataclasses, build
them back with the same defaults, and a refusal names the flag on the command line and the field in
Python."""

import pytest

from moestream.budget import Budget
from moestream.cli import build_parser, main
from moestream.config import BatchingConfig, EngineConfig, WorkerConfig
from moestream.errors import MoestreamError
from moestream.settings import from_args


def _args(*argv: str):
    return build_parser(list(argv)).parse_args(list(argv))


def test_no_flags_give_the_dataclass_defaults():
    assert from_args(EngineConfig, _args("generate", "--model", "m", "--prompt", "p")) == EngineConfig()
    assert from_args(WorkerConfig, _args("serve", "--model", "m")) == WorkerConfig()


def test_flags_build_the_nested_configs():
    args = _args("serve", "--model", "m", "--max-queue", "5", "--max-batch-size", "3", "--kv-budget", "2MiB",
                 "--horizon-layers", "1", "--chunk-size", "256KiB", "--buffered-io", "--no-reorder")
    assert from_args(WorkerConfig, args) == WorkerConfig(
        max_queue=5, batching=BatchingConfig(max_batch_size=3, kv_budget_bytes=2 << 20))
    engine = from_args(EngineConfig, args, expert_budget="0.5")
    assert engine == EngineConfig(expert_budget=Budget(ratio=0.5), horizon_layers=1, chunk_bytes=256 << 10,
                                  direct_io=False, reorder=False)


@pytest.mark.parametrize("command, flags, message", [
    ("generate", ["--horizon-layers", "-1"], "--horizon-layers must be >= 0, got -1"),
    ("generate", ["--transfer-timeout-s", "0"], "--transfer-timeout-s must be > 0, got 0.0"),
    ("generate", ["--chunks-in-flight", "0"], "--chunks-in-flight must be >= 1, got 0"),
    ("serve", ["--kv-budget", "0.5"], "--kv-budget: takes a size like 512MiB, not a ratio ('0.5')"),
    ("serve", ["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    ("serve", ["--max-prefill-delay-ms", "-1"], "--max-prefill-delay-ms must be >= 0, got -1.0"),
])
def test_a_bad_flag_is_one_line_naming_it(tiny_checkpoint, capsys, command, flags, message):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, "--model", str(model), *prompt, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moestream: error: {message}"


def test_python_refusals_name_the_field():
    with pytest.raises(MoestreamError, match="^chunks_in_flight must be >= 1, got 0$"):
        EngineConfig(chunks_in_flight=0)
    with pytest.raises(MoestreamError, match="^max_batch_size must be >= 1, got 0$"):
        BatchingConfig(max_batch_size=0)
