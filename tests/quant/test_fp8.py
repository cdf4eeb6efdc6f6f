"""FP8 block-scaled weights decode as transformers dequantizes the same bytes (its finegrained FP8
integration: `Fp8Dequantize`, which loading with dequantize=True runs, and the backward pass's
`_dequantize_fp8_weight`, which also handles partial blocks)."""

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from moestream.checkpoint.index import build_index
from moestream.errors import CheckpointError
from moestream.quant import codec_for
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.fp8 import decode, encode
from moestream.topology import ExpertKey
from tests.quant.slots import disk_tensor, read_slot

BLOCK = [128, 128]


def _codec(**fields):
    config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK} | fields
    return codec_for(type("Config", (), {"quantization_config": config})())


def _random_fp8(shape, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return encode(torch.randn(shape, generator=generator) * 0.02, BLOCK)


@pytest.mark.parametrize("shape", [(64, 64), (256, 128), (96, 384)])
def test_whole_blocks_decode_as_transformers_loads_them(shape):
    weight, scale_inv = _random_fp8(shape)
    theirs = Fp8Dequantize(None).convert({"weight": weight, "weight_scale_inv": scale_inv})["weight"]
    assert torch.equal(decode(weight, scale_inv, torch.float32, BLOCK), theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_blocks_decode_as_transformers_backward_does(dtype):
    weight, scale_inv = _random_fp8((200, 300))
    assert scale_inv.shape == (2, 3)
    theirs = _dequantize_fp8_weight(weight, scale_inv, BLOCK, torch.float32).to(dtype)
    assert torch.equal(decode(weight, scale_inv, dtype, BLOCK), theirs)


def test_encode_keeps_each_block_within_fp8_precision():
    values = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    weight, scale_inv = encode(values, BLOCK)
    step = scale_inv.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    error = (decode(weight, scale_inv, torch.float32, BLOCK) - values).abs()
    assert torch.all(error <= values.abs() * 2**-4 + step * 2**-9)  # 3 mantissa bits; subnormals below 2**-6


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_slots_decode_as_transformers_on_the_disk_tensors(tiny_checkpoint, family):
    path = tiny_checkpoint(family, num_layers=2, quant="fp8")
    checkpoint = build_index(path)
    decoder = ExpertDecoder(checkpoint.codec, checkpoint.experts.layout, torch.float32)
    block, expert = checkpoint.blocks[-1], 3
    weights = decoder(checkpoint.experts.views(read_slot(checkpoint, ExpertKey(block.moe_index, expert))))
    dequantized = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"{block.disk_prefix}.experts.{expert}.{proj}"
        tensors = {"weight": disk_tensor(path, name + ".weight"), "weight_scale_inv": disk_tensor(path, name + ".weight_scale_inv")}
        dequantized[proj] = Fp8Dequantize(None).convert(tensors)["weight"]
    assert torch.equal(weights["gate_up_proj"], torch.cat([dequantized["gate_proj"], dequantized["up_proj"]]))
    assert torch.equal(weights["down_proj"], dequantized["down_proj"])
    assert checkpoint.topology.expert_bytes == 3 * 64 * 64 + 3 * 4  # fp8 weights and one float32 scale each


def test_dense_groups_pair_each_weight_with_its_scales():
    names = ["a.q_proj.weight", "a.q_proj.weight_scale_inv", "a.norm.weight", "b.o_proj.weight",
             "b.o_proj.weight_scale_inv", "b.o_proj.activation_scale"]
    assert _codec().dense_groups(names) == {
        "a.q_proj.weight": {"weight": "a.q_proj.weight", "weight_scale_inv": "a.q_proj.weight_scale_inv"},
        "b.o_proj.weight": {"weight": "b.o_proj.weight", "weight_scale_inv": "b.o_proj.weight_scale_inv",
                            "activation_scale": "b.o_proj.activation_scale"},
    }
    weight, scale_inv = _random_fp8((96, 32))
    dense = _codec().decode_dense({"weight": weight, "weight_scale_inv": scale_inv}, torch.bfloat16)
    assert torch.equal(dense, (weight.float() * scale_inv).to(torch.bfloat16))


def test_per_tensor_scales_and_ue8m0_bytes_decode_as_transformers():
    weight, scale_inv = encode(torch.randn(64, 96) * 0.02, None)
    assert scale_inv.shape == ()
    theirs = _dequantize_fp8_weight(weight, scale_inv, None, torch.float32)
    assert torch.equal(_codec(weight_block_size=None).decode_dense({"weight": weight, "weight_scale_inv": scale_inv},
                                                                  torch.float32), theirs)
    exponents = torch.randint(110, 130, (1, 1), dtype=torch.uint8)
    theirs = Fp8Dequantize(None).convert({"weight": weight, "weight_scale_inv": exponents})["weight"]
    assert torch.equal(decode(weight, exponents, torch.bfloat16, BLOCK), theirs)


@pytest.mark.parametrize("fields,words", [({"fmt": "e5m2"}, "e5m2"), ({"weight_block_size": [128]}, "two")])
def test_unsupported_variants_are_refused_naming_them(fields, words):
    with pytest.raises(CheckpointError, match=words):
        _codec(**fields)


def test_scales_of_the_wrong_grid_are_refused():
    with pytest.raises(CheckpointError, match=r"scales \(2, 2\)"):
        _codec().dense_shapes({"down_proj.0.weight": (64, 64), "down_proj.0.weight_scale_inv": (2, 2)})
