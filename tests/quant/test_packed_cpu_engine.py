"""`--quant-kernel packed-cpu` through the engine and the CLI: small seeded checkpoints in every format it reads
(int4 and int8 written by `quantize --layout gptq`, int4 and int8 in compressed-tensors' layout, FP8 block and
MXFP4 written by `make-model --quant`) generate greedily with high top-1 agreement with the exact path
(teacher-forced on the exact path's continuation, as `bench quant` measures it), and the kernel refuses, in one
line and exit 2, what it does not cover and a copy an older `quantize` wrote."""

import json
import shutil

import pytest

from moestream.bench.quant import closeness
from moestream.checkpoint.demo import PROMPTS
from moestream.checkpoint.index import build_index
from moestream.checkpoint.quantize import quantize_checkpoint
from moestream.cli import main
from moestream.config import QUANT_KERNELS as CONFIG_NAMES
from moestream.config import EngineConfig
from moestream.errors import MoestreamError
from moestream.quant.encode import IntScheme
from moestream.quant.kernels import LAYOUT_KEY, LAYOUT_VERSION, QUANT_KERNELS, quant_kernel
from tests.cli.test_generate import _error_line

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """{name: checkpoint}: the unquantized source, its int4 and int8 copies in GPTQ's layout and its int4 copy in
    compressed-tensors' (what `quantize` wrote before --layout), written once. Its weights are drawn wide (std
    0.3) so that the experts move the logits: at transformers' 0.02 a kernel with its zero points off by one
    still agrees on every top-1 token (KL 1e-5); here it agrees on 41% (KL 1.1)."""
    source = tiny_checkpoint("deepseek_v2", num_layers=3, dtype="bf16", config_overrides={"initializer_range": 0.3})
    root = tmp_path_factory.mktemp("packed_cpu")
    schemes = {"gptq4": IntScheme(4, 32, "gptq"), "gptq8": IntScheme(8, None, "gptq"), "compressed": IntScheme(4, 32),
               "compressed8": IntScheme(8, 32)}
    wide = {"config_overrides": {"initializer_range": 0.1}}  # at 0.3 these two amplify bf16 rounding chaotically
    return {"source": source} | {name: quantize_checkpoint(source, root / name, scheme)
                                 for name, scheme in schemes.items()} | {
        "fp8": tiny_checkpoint("qwen3_moe", num_layers=3, dtype="bf16", quant="fp8", **wide),
        "mxfp4": tiny_checkpoint("gpt_oss", num_layers=2, dtype="bf16", quant="mxfp4", **wide)}


@pytest.mark.parametrize("name, agreement", [("gptq4", 0.99), ("gptq8", 0.99), ("compressed", 0.99),
                                             ("compressed8", 0.99), ("fp8", 0.95), ("mxfp4", 0.95)])
def test_greedy_generation_agrees_with_the_exact_path(checkpoints, name, agreement):
    """Measured: 1.0 and KL 1.6e-4 (int), 0.97 and 6.6e-4 (fp8), 0.97 and 2.8e-5 (mxfp4), each miss one near-tie
    (the exact path's own weights are rounded to bf16, the kernel's are not); MXFP4's even and odd columns
    swapped gives 0.0 and 0.43."""
    error = closeness(checkpoints[name], "packed-cpu", PROMPTS, NEW_TOKENS, threads=1)
    assert error.positions == len(PROMPTS) * NEW_TOKENS
    assert error.top1_agreement >= agreement and error.mean_kl < 1e-3
    assert error.max_abs_logit_error > 0  # the kernel ran: its logits are not the exact path's bit for bit


def test_bench_quant_prints_the_kernels_closeness(checkpoints, tmp_path, capsys):
    out = tmp_path / "bench.json"
    models = f"{checkpoints['source']},{checkpoints['gptq4']}"
    code = main(["bench", "quant", "--models", models, "--policy", "lru", "--max-new-tokens", "3", "--buffered-io",
                 "--quant-kernel", "packed-cpu", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert "does not cover unquantized experts" in rows[0]["kernel_refusal"]
    assert rows[2]["kernel_top1_agreement"] >= 0.99 and rows[2]["kernel_mlp_ms"] > 0
    assert rows[2]["kernel_positions"] == 3  # the first demo prompt (--prompts 1), 3 tokens
    assert "top-1 agreement" in capsys.readouterr().out


def test_the_layout_of_an_older_quantize_is_refused_saying_to_rerun_it(checkpoints, tmp_path, capsys):
    older = tmp_path / "older"
    shutil.copytree(checkpoints["compressed"], older)
    config = json.loads((older / "config.json").read_text())
    assert config["quantization_config"][LAYOUT_KEY] == LAYOUT_VERSION  # what `quantize` writes now
    config["quantization_config"][LAYOUT_KEY] = LAYOUT_VERSION - 1
    (older / "config.json").write_text(json.dumps(config))
    code = main(["generate", "--model", str(older), "--prompt", "Hi", "--max-new-tokens", "1", "--buffered-io",
                 "--quant-kernel", "packed-cpu"])
    line = _error_line(capsys)
    assert code == 2
    assert f"was written by an older `moestream quantize` (layout {LAYOUT_VERSION - 1}" in line
    assert "re-run `moestream quantize`" in line
    assert main(["generate", "--model", str(older), "--prompt", "Hi", "--max-new-tokens", "1", "--buffered-io"]) == 0


@pytest.mark.parametrize("case", ["unquantized", "cuda"])
def test_a_format_or_device_it_does_not_cover_is_named_with_the_kernels_that_do(checkpoints, tiny_checkpoint, case):
    path, device, words = {"unquantized": (checkpoints["source"], "cpu", "unquantized experts"),
                           "cuda": (checkpoints["gptq4"], "cuda:0", "--device cuda:0")}[case]
    with pytest.raises(MoestreamError) as refused:
        quant_kernel("packed-cpu", build_index(path), device)
    message = str(refused.value)
    assert "\n" not in message and words in message and message.endswith("kernels that cover " + (
        "it: exact" if case == "cuda" else "them: exact"))


def test_kernels_are_named_once_for_the_config_and_an_unknown_one_is_refused():
    assert tuple(QUANT_KERNELS.names()) == CONFIG_NAMES
    with pytest.raises(MoestreamError, match="unknown --quant-kernel 'fast'; choose from exact, packed-cpu"):
        EngineConfig(quant_kernel="fast")


def test_quantize_writes_gptqs_layout_on_request(checkpoints, tmp_path):
    out = tmp_path / "int4-gptq"
    code = main(["quantize", "--model", str(checkpoints["source"]), "--format", "int4", "--layout", "gptq",
                 "--out", str(out), "--no-error"])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert code == 0
    assert config == {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
                      "checkpoint_format": "gptq", LAYOUT_KEY: LAYOUT_VERSION}
    assert quant_kernel("packed-cpu", build_index(out), "cpu") is not None
