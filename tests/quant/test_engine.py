"""A quantized checkpoint generates exactly what transformers' model generates with the same experts
(and quantized dense linears) dequantized by the reference dequantization, offloading on and off,
sync and async."""

import pytest

from moestream.checkpoint.index import build_index
from moestream.checkpoint.quantize import quantize_checkpoint
from moestream.quant.encode import IntScheme
from tests.quant.checkpoints import generate_tokens, reference_model, write_gptq
from tests.runtime.conftest import reference_generate

NEW_TOKENS = 6
SCHEMES = {"int4": IntScheme(4, 32), "int8": IntScheme(8, None)}
CASES = [("mixtral", "int4", "fp32"), ("mixtral", "int8", "fp32"), ("mixtral", "gptq", "bf16"),
         ("mixtral", "gptq+attention", "fp32"),
         ("qwen3_moe", "int4", "bf16"), ("deepseek_v2", "int4", "bf16")]


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """(family, format, dtype) -> (dense checkpoint, quantized copy, reference model), built once."""
    made = {}

    def get(family, fmt, dtype):
        key = (family, fmt, dtype)
        if key not in made:
            source = tiny_checkpoint(family, num_layers=3, dtype=dtype)
            out = tmp_path_factory.mktemp("quantized") / f"{family}-{fmt}"
            if fmt.startswith("gptq"):
                write_gptq(source, out, attention=fmt.endswith("attention"))
            else:
                quantize_checkpoint(source, out, SCHEMES[fmt])
            made[key] = source, out, reference_model(source, out)
        return made[key]

    return get


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("budget", ["min", "1.0"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_greedy_tokens_match_transformers_with_dequantized_experts(quantized, case, budget, sync):
    source, path, model = quantized(*case)
    prompts, result, pad_id = generate_tokens(path, budget, sync, NEW_TOKENS)
    assert result.token_ids == reference_generate(model, prompts, NEW_TOKENS, pad_id)
    assert (result.metrics.expert_misses > 0) == (budget != "1.0")


def test_slots_and_links_carry_the_quantized_bytes(quantized):
    source, path, _ = quantized("mixtral", "int4", "fp32")
    dense, packed = build_index(source).topology.expert_bytes, build_index(path).topology.expert_bytes
    assert packed < dense / 5  # 4-bit weights and a fp32 scale per 32 of them, against fp32 weights
    _, result, _ = generate_tokens(path, "min", False, NEW_TOKENS)
    moved = result.metrics.bytes_read["disk"]
    assert moved == result.metrics.expert_misses * packed
