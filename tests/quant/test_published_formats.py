"""make-model's checkpoints in the published formats, for every family that declares one (`quant_formats`:
GPT-OSS's MXFP4; the FP8 block releases of DeepSeek-V3.x, GLM, Qwen3.x and MiniMax-M2; W4A16
compressed-tensors) generate exactly what transformers' own model of the same checkpoint generates:
loaded dequantized by transformers (`Mxfp4Config(dequantize=True)`; FP8 on a CPU, where transformers
dequantizes on its own), or for W4A16, whose transformers loader needs the compressed-tensors package,
the unquantized checkpoint of the same seed with each expert set to the reference dequantization.
Offloading on (the smallest budget) and off (every expert resident), sync and async (`RUNS`; the families
a format was first written for run all four, the others offloaded async and resident sync). FP8 experts
stay FP8 on disk and in slots; FP8 dense linears load as transformers dequantizes them."""

import pytest
import torch
import transformers
from transformers import Mxfp4Config

from moestream.checkpoint.index import build_index
from moestream.checkpoint.spec import quant_families
from moestream.families import FAMILIES
from tests.quant.checkpoints import generate_tokens, reference_model
from tests.runtime.conftest import reference_generate

NEW_TOKENS = 6
DEFAULT_DTYPES = ("bf16",)  # a (family, format)'s checkpoint dtypes, unless DTYPES names others
DTYPES = {("gpt_oss", "mxfp4"): ("fp32", "bf16"), ("qwen3_moe", "fp8"): ("fp32",), ("mixtral", "w4a16"): ("fp32",)}
CASES = [(family, fmt, dtype) for fmt, families in quant_families().items() for family in families
         for dtype in DTYPES.get((family, fmt), DEFAULT_DTYPES)]
RUNS = [("min", False), ("min", True), ("1.0", False), ("1.0", True)]  # (budget, sync): offloaded, resident
# the formats' first families run every (budget, sync); to keep the suite fast, the other families run
# offloaded async (quantized experts read from disk into slots and over links) and resident sync
EVERY_RUN = {("gpt_oss", "mxfp4"), ("deepseek_v3", "fp8"), ("qwen3_moe", "fp8"), ("mixtral", "w4a16"),
             ("qwen3_moe", "w4a16")}
SOME_RUNS = [("min", False), ("1.0", True)]
GREEDY = [pytest.param(case, budget, sync, id="-".join((*case, budget, "sync" if sync else "async")))
          for case in CASES for budget, sync in (RUNS if case[:2] in EVERY_RUN else SOME_RUNS)]
LOAD_KWARGS = {"mxfp4": {"quantization_config": Mxfp4Config(dequantize=True)}}
# Config fields of a family's test checkpoints where the small default would leave an FP8 weight with a side
# above 128 that is not a multiple of 128 (Qwen3-Next's in_proj_qkvz: 192 rows): transformers' CPU
# dequantization takes the block from the scale grid (192 rows / 2 scale rows = 96), not weight_block_size,
# so it would disagree with the format (and moestream) on such weights; released widths are multiples of 128.
OVERRIDES = {"qwen3_next": {"linear_num_value_heads": 2}}


@pytest.fixture(scope="module")
def published(tiny_checkpoint):
    """(family, format, dtype) -> (checkpoint, transformers' reference model), built once."""
    made = {}

    def get(family, fmt, dtype):
        key = (family, fmt, dtype)
        if key not in made:
            fields = {"num_layers": 3, "dtype": dtype}
            if family in OVERRIDES:
                fields["config_overrides"] = OVERRIDES[family]
            path = tiny_checkpoint(family, quant=fmt, **fields)
            made[key] = path, _reference(family, fmt, path, lambda: tiny_checkpoint(family, **fields))
        return made[key]

    return get


def _reference(family: str, fmt: str, path, unquantized):
    """transformers' model of the checkpoint at path; `unquantized()` makes the dense one of the same seed."""
    if fmt == "w4a16":
        return reference_model(unquantized(), path)
    auto_class = getattr(transformers, FAMILIES.get(family).auto_class)
    return auto_class.from_pretrained(path, **LOAD_KWARGS.get(fmt, {})).eval()


@pytest.mark.parametrize("case,budget,sync", GREEDY)
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


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "fp8"], ids=lambda c: "-".join(c))
def test_fp8_experts_stay_quantized_on_disk_and_in_slots(published, case):
    path, _ = published(*case)
    index = build_index(path)
    dense = set(index.dense_names())
    experts = [info for name, info in index.tensors.items() if name not in dense]
    weights = [info for info in experts if info.name.endswith(".weight")]
    assert weights and all(info.dtype == torch.float8_e4m3fn for info in weights)
    assert all(info.dtype == torch.float32 for info in experts if info.name.endswith(".weight_scale_inv"))
    topology = index.topology  # a slot holds an expert's disk bytes: FP8 weights and their scales
    assert topology.expert_bytes * topology.num_experts * len(index.blocks) == sum(info.nbytes for info in experts)
    routers = [name for name in dense if name.rpartition(".")[0].rpartition(".")[2] in ("gate", "shared_expert_gate")]
    assert routers and all(index.tensors[name].dtype != torch.float8_e4m3fn for name in routers)
