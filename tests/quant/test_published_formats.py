"""make-model's checkpoints in the published formats (GPT-OSS's MXFP4, DeepSeek-V3's and Qwen3's FP8, W4A16
compressed-tensors) generate exactly what transformers' own model of the same checkpoint generates:
loaded dequantized by transformers (`Mxfp4Config(dequantize=True)`; FP8 on a CPU, where transformers
dequantizes on its own), or for W4A16, whose transformers loader needs the compressed-tensors package,
the unquantized checkpoint of the same seed with each expert set to the reference dequantization.
Offloading on (the smallest budget) and off (every expert resident), sync and async."""

import pytest
import torch
import transformers
from transformers import Mxfp4Config

from moestream.checkpoint.index import build_index
from moestream.families import FAMILIES
from tests.quant.checkpoints import generate_tokens, reference_model
from tests.runtime.conftest import reference_generate

NEW_TOKENS = 6
CASES = [("gpt_oss", "mxfp4", "fp32"), ("gpt_oss", "mxfp4", "bf16"), ("deepseek_v3", "fp8", "bf16"),
         ("qwen3_moe", "fp8", "fp32"), ("mixtral", "w4a16", "fp32"), ("qwen3_moe", "w4a16", "bf16")]
LOAD_KWARGS = {"mxfp4": {"quantization_config": Mxfp4Config(dequantize=True)}}


@pytest.fixture(scope="module")
def published(tiny_checkpoint):
    """(family, format, dtype) -> (checkpoint, transformers' reference model), built once."""
    made = {}

    def get(family, fmt, dtype):
        key = (family, fmt, dtype)
        if key not in made:
            path = tiny_checkpoint(family, num_layers=3, dtype=dtype, quant=fmt)
            made[key] = path, _reference(family, fmt, path, tiny_checkpoint(family, num_layers=3, dtype=dtype))
        return made[key]

    return get


def _reference(family: str, fmt: str, path, unquantized):
    if fmt == "w4a16":
        return reference_model(unquantized, path)
    auto_class = getattr(transformers, FAMILIES.get(family).auto_class)
    return auto_class.from_pretrained(path, **LOAD_KWARGS.get(fmt, {})).eval()


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("budget", ["min", "1.0"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_greedy_tokens_match_transformers_on_the_same_checkpoint(published, case, budget, sync):
    path, model = published(*case)
    prompts, result, pad_id = generate_tokens(path, budget, sync, NEW_TOKENS)
    assert result.token_ids == reference_generate(model, prompts, NEW_TOKENS, pad_id)
    assert (result.metrics.expert_misses > 0) == (budget != "1.0")
    assert result.metrics.bytes_read["disk"] == result.metrics.expert_misses * build_index(path).topology.expert_bytes


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "fp8"], ids=lambda c: "-".join(c))
def test_fp8_dense_linears_load_as_transformers_dequantizes_them(published, case):
    from moestream.runtime.loader import load_model

    path, model = published(*case)
    theirs = model.state_dict()
    ours = {key: value for key, value in load_model(build_index(path), "cpu").state_dict().items() if not value.is_meta}
    assert any(".self_attn." in key for key in ours)
    assert all(torch.equal(value, theirs[key]) for key, value in ours.items())
