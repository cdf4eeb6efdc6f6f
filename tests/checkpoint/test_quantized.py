"""make-model's quantized checkpoints: each format's published layout and config, the quantization of the
unquantized checkpoint of the same seed, loaded by transformers without missing keys; damage to a quantized
shard is caught by the manifest; a quantization moestream cannot read is refused at open in one line."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from moestream.checkpoint.index import build_index
from moestream.checkpoint.manifest import IntegrityError
from moestream.checkpoint.quantized import QUANT_LAYOUTS
from moestream.checkpoint.spec import QUANT_WIDTH_MULTIPLE, ModelSpec
from moestream.checkpoint.verify import verify
from moestream.cli import main
from moestream.errors import CheckpointError
from moestream.families import FAMILIES
from moestream.quant import CODECS
from moestream.quant.fp8 import decode as fp8_decode
from tests.checkpoint.damage import copy_checkpoint, scramble_experts

LOAD_KWARGS = {"mxfp4": {"quantization_config": Mxfp4Config(dequantize=True)}}


def _dtypes(path) -> dict[str, str]:
    """Every disk tensor's safetensors dtype name, by name."""
    with safe_open(path / "model.safetensors", "pt") as shard:
        return {name: shard.get_slice(name).get_dtype() for name in shard.keys()}


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as shard:
        return {name: shard.get_tensor(name) for name in shard.keys()}


def _quant_method(path) -> str:
    return json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]


def test_mxfp4_is_gpt_oss_layout(tiny_checkpoint):
    path = tiny_checkpoint("gpt_oss", num_layers=2, quant="mxfp4")
    dtypes, tensors = _dtypes(path), _tensors(path)
    experts = {name.rpartition(".")[2]: dtype for name, dtype in dtypes.items() if ".mlp.experts." in name}
    assert experts == {"gate_up_proj_blocks": "U8", "gate_up_proj_scales": "U8", "gate_up_proj_bias": "F32",
                       "down_proj_blocks": "U8", "down_proj_scales": "U8", "down_proj_bias": "F32"}
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (8, 128, 2, 16)  # [E, 2I, H/32, 16]
    assert tensors["model.layers.0.mlp.experts.down_proj_scales"].shape == (8, 64, 2)  # [E, H, I/32]
    assert {d for name, d in dtypes.items() if ".mlp.experts." not in name} == {"F32"}
    assert _quant_method(path) == "mxfp4"


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_fp8_quantizes_every_decoder_linear_with_block_scales(tiny_checkpoint, family):
    path = tiny_checkpoint(family, num_layers=2, quant="fp8")
    dtypes, tensors = _dtypes(path), _tensors(path)
    fp8 = {name for name, dtype in dtypes.items() if dtype == "F8_E4M3"}
    linears = {name for name in dtypes if name.startswith("model.layers.") and "_proj" in name
               and name.endswith(".weight")}
    assert fp8 == linears and any(".self_attn." in name for name in fp8)
    for name in fp8:
        scales = tensors[name + "_scale_inv"]
        assert scales.dtype == torch.float32 and scales.shape == tuple(-(-s // 128) for s in tensors[name].shape)
    routers = [name for name in dtypes if name.endswith("mlp.gate.weight")]
    assert routers and all(dtypes[name] == "F32" for name in routers + ["lm_head.weight", "model.embed_tokens.weight"])
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_w4a16_packs_each_expert_linear(tiny_checkpoint, family):
    path = tiny_checkpoint(family, num_layers=2, quant="w4a16")
    dtypes, tensors = _dtypes(path), _tensors(path)
    expert = {name.rpartition(".")[2]: dtype for name, dtype in dtypes.items() if ".experts.3." in name}
    assert expert == {"weight_packed": "I32", "weight_scale": "F32", "weight_shape": "I64"}
    stem = next(name for name in dtypes if ".experts.3." in name).rpartition(".")[0] + "."  # one linear [64, 64]
    assert tensors[stem + "weight_packed"].shape == (64, 8) and tensors[stem + "weight_scale"].shape == (64, 1)
    assert tensors[stem + "weight_shape"].tolist() == [64, 64]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "pack-quantized")
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 64  # gcd(128, widths of 64)


@pytest.mark.parametrize("family,fmt", [("gpt_oss", "mxfp4"), ("deepseek_v3", "fp8")])
def test_quantized_tensors_encode_the_unquantized_checkpoint_of_the_same_seed(tiny_checkpoint, family, fmt):
    quantized = _tensors(tiny_checkpoint(family, num_layers=2, quant=fmt))
    dense = _tensors(tiny_checkpoint(family, num_layers=2))
    same = [name for name in dense if name in quantized and quantized[name].dtype == dense[name].dtype]
    assert "model.embed_tokens.weight" in same and all(torch.equal(quantized[n], dense[n]) for n in same)
    for name, weight in dense.items():
        if fmt == "mxfp4" and name + "_blocks" in quantized:
            decoded = convert_moe_packed_tensors(quantized[name + "_blocks"], quantized[name + "_scales"],
                                                 dtype=torch.float32)
            assert torch.allclose(decoded, weight, atol=weight.abs().max() / 3)  # 4-bit: a third of the range
        elif fmt == "fp8" and name not in same:
            decoded = fp8_decode(quantized[name], quantized[name + "_scale_inv"], torch.float32, (128, 128))
            assert torch.allclose(decoded, weight, rtol=2**-4, atol=weight.abs().max() * 2**-9)


@pytest.mark.parametrize("family,fmt", [("gpt_oss", "mxfp4"), ("deepseek_v3", "fp8"), ("qwen3_moe", "fp8")])
def test_transformers_loads_it_without_missing_keys(tiny_checkpoint, family, fmt):
    path = tiny_checkpoint(family, num_layers=2, quant=fmt)
    auto_class = getattr(transformers, FAMILIES.get(family).auto_class)
    model, info = auto_class.from_pretrained(path, output_loading_info=True, **LOAD_KWARGS.get(fmt, {}))
    assert not any(info.values()), info
    assert model.config.model_type == family


def test_every_format_the_flag_offers_has_a_layout():
    assert sorted(QUANT_WIDTH_MULTIPLE) == QUANT_LAYOUTS.names()


@pytest.mark.parametrize("family,fmt,problem", [
    ("mixtral", "fp8", "--quant fp8 is written for deepseek_v3, .*qwen3_moe.*, not mixtral"),
    ("gpt_oss", "int3", "unknown quantized format 'int3'"),
])
def test_a_format_for_another_family_is_refused(family, fmt, problem):
    with pytest.raises(CheckpointError, match=problem):
        ModelSpec(family, quant=fmt)


def test_mxfp4_widths_must_hold_whole_groups(tmp_path, capsys):
    assert main(["make-model", "gpt_oss", "--quant", "mxfp4", "--hidden-size", "48", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multiples of 32, got 48 and 64" in err[0]


@pytest.mark.parametrize("family,fmt", [("gpt_oss", "mxfp4"), ("deepseek_v3", "fp8")])
def test_a_damaged_quantized_shard_fails_against_the_manifest(tiny_checkpoint, tmp_path, family, fmt):
    path = copy_checkpoint(tiny_checkpoint(family, num_layers=2, quant=fmt), tmp_path / "model")
    assert verify(path).manifest_written
    (info, _), *_ = scramble_experts(path, layer=0)
    with pytest.raises(IntegrityError) as error:
        verify(path)
    assert f"tensor {info.name}" in str(error.value) and "MoE layer 0 expert 0" in str(error.value)


def test_an_unsupported_quantization_is_refused_at_open_in_one_line(tiny_checkpoint, tmp_path, capsys):
    path = copy_checkpoint(tiny_checkpoint("mixtral", num_layers=2), tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        build_index(path)
    assert "'awq'" in str(error.value) and ", ".join(CODECS.names()) in str(error.value)
    assert main(["generate", "--model", str(path), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("moestream")]
    assert len(err) == 1 and "unsupported quantization method 'awq'" in err[0] and "mxfp4" in err[0]
