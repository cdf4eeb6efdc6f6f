"""FP8 block-scaled weights decode as transformers dequantizes the same bytes (its finegrained FP8
integration: `Fp8Dequantize`, which loading with dequantize=True runs, and the backward pass's
`_dequantize_fp8_weight`, which also handles partial blocks)."""

import math

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from moestream.checkpoint.index import build_index
from moestream.errors import CheckpointError
from moestream.quant import codec_for
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.fp8 import FP8, decode, encode, scale_grid
from moestream.topology import ExpertKey
from tests.quant.slots import disk_tensor, read_slot

BLOCK = [128, 128]


def _codec(**fields):
    config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK} | fields
    return codec_for(type("Config", (), {"quantization_config": config})())


def _random_fp8(shape, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return encode(torch.randn(shape, generator=generator) * 0.02, BLOCK)


def _fp8_blocks(shape, grid, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random finite float8 bytes [R, C] and a different float32 scale for every block of `grid`, made here
    rather than by encode (so a bug encode shares cannot cancel out): any other placement of the scales,
    transposed or with rows and columns of a block swapped, gives another product."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.randint(0, 0x7F, shape, generator=generator, dtype=torch.uint8)  # 0x7f and 0xff are NaN
    sign = torch.randint(0, 2, shape, generator=generator, dtype=torch.uint8) << 7
    scales = (torch.randperm(math.prod(grid), generator=generator) + 1).float().reshape(grid) * 2**-10
    return (magnitude | sign).view(FP8), scales


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


# Grids of 2x2 and more (a scale read at block (j, i) for (i, j) shows) and blocks of bm != bn (rows and
# columns of a block swapped show); the expected grid is written out, not computed by scale_grid.
WHOLE = [((256, 256), BLOCK, (2, 2)), ((256, 384), BLOCK, (2, 3)), ((384, 256), BLOCK, (3, 2)),
         ((128, 256), [64, 128], (2, 2)), ((192, 384), [64, 128], (3, 3)), ((384, 192), [128, 64], (3, 3))]
PARTIAL = [((150, 300), [64, 128], (3, 3)), ((150, 300), [128, 64], (2, 5)), ((300, 150), [64, 128], (5, 2))]


def _cases(cases):
    ids = ["{}x{}-blocks{}x{}".format(*shape, *block) for shape, block, _ in cases]
    return pytest.mark.parametrize("shape,block,grid", cases, ids=ids)


@_cases(WHOLE)
def test_block_grids_of_2x2_and_more_decode_as_transformers_loads_them(shape, block, grid):
    weight, scale_inv = _fp8_blocks(shape, grid)
    assert scale_grid(shape, block) == grid
    theirs = Fp8Dequantize(None).convert({"weight": weight, "weight_scale_inv": scale_inv})["weight"]
    assert torch.equal(decode(weight, scale_inv, torch.float32, block), theirs)
    assert torch.equal(decode(weight, scale_inv, torch.bfloat16, block), theirs.to(torch.bfloat16))


@_cases(PARTIAL + WHOLE[3:])
def test_non_square_blocks_decode_as_transformers_backward_does(shape, block, grid):
    weight, scale_inv = _fp8_blocks(shape, grid, seed=1)
    assert scale_grid(shape, block) == grid
    theirs = _dequantize_fp8_weight(weight, scale_inv, block, torch.float32)
    assert torch.equal(decode(weight, scale_inv, torch.float32, block), theirs)


@_cases(PARTIAL[:2] + WHOLE[3:5])
def test_the_codec_decodes_with_its_configs_non_square_weight_block_size(shape, block, grid):
    codec = _codec(weight_block_size=block)
    weight, scale_inv = _fp8_blocks(shape, grid, seed=2)
    theirs = _dequantize_fp8_weight(weight, scale_inv, block, torch.float32)
    dense = codec.decode_dense({"weight": weight, "weight_scale_inv": scale_inv}, torch.bfloat16)
    assert torch.equal(dense, theirs.to(torch.bfloat16))
    # an expert's gate_proj then up_proj, each into its rows of gate_up_proj
    up, up_scale = _fp8_blocks(shape, grid, seed=3)
    parts = {"gate_up_proj.0.weight": weight, "gate_up_proj.0.weight_scale_inv": scale_inv,
             "gate_up_proj.1.weight": up, "gate_up_proj.1.weight_scale_inv": up_scale}
    fused = (2 * shape[0], shape[1])
    assert codec.dense_shapes({name: tuple(t.shape) for name, t in parts.items()}) == {"gate_up_proj": fused}
    out = codec.decode(parts, {"gate_up_proj": torch.empty(fused, dtype=torch.float32)})["gate_up_proj"]
    assert torch.equal(out, torch.cat([theirs, _dequantize_fp8_weight(up, up_scale, block, torch.float32)]))


def test_scales_of_the_transposed_block_grid_are_refused():
    codec = _codec(weight_block_size=[64, 128])  # [150, 300] needs (3, 3); blocks of [128, 64] would need (2, 5)
    with pytest.raises(CheckpointError, match=r"scales \(2, 5\)"):
        codec.dense_shapes({"down_proj.0.weight": (150, 300), "down_proj.0.weight_scale_inv": (2, 5)})
    assert codec.dense_shapes({"down_proj.0.weight": (150, 300), "down_proj.0.weight_scale_inv": (3, 3)}) == {
        "down_proj": (150, 300)}


@pytest.mark.parametrize("block,grid", [(BLOCK, (2, 3)), ([64, 128], (4, 3))])
def test_encode_keeps_each_block_within_fp8_precision(block, grid):
    values = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    weight, scale_inv = encode(values, block)
    assert scale_inv.shape == grid
    step = scale_inv.repeat_interleave(block[0], 0)[:200].repeat_interleave(block[1], 1)[:, :300]
    error = (decode(weight, scale_inv, torch.float32, block) - values).abs()
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


def test_the_fmt_named_by_its_dtype_is_e4m3():
    assert _codec(fmt="float8_e4m3fn").block == _codec(fmt="e4m3").block  # MiniMax-M2's config.json says so
