"""The packed-cpu kernel (quant/packed_cpu.py) against the exact path: one linear's product from GPTQ's packed
words against the reference dequantization (tests/quant/reference.py) times x in float64, and one expert's
MLP against decode-then-MLP; and `quantize --layout gptq`, which writes what the kernel reads.

Tolerances, stated: the product sums in float32, each group's integers first and its zero point taken off
by x's sum over the group, so it stays within 2**b * 2e-6 of sum_i |x_i| * scale_i of each output (b: the
bits); the MLP in bf16 within 2% of the largest output magnitude of the exact path, which rounds every
weight to bf16. A wrong nibble, group, scale or zero point is off by about a scale * |x| per output."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moestream.errors import CheckpointError
from moestream.quant import CODECS, codec_for, gptq
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.encode import IntScheme, quantize
from moestream.quant.packed_cpu import gptq_product
from moestream.quant.packed_formats import MAX_ROWS, PackedExperts
from tests.quant import reference
from tests.quant.test_compressed_tensors import packing_pack

INTER, HIDDEN = 40, 64  # an expert's width and the model's (outputs multiples of 8, inputs of the groups)


def random_gptq(rows: int, cols: int, bits: int, group: int | None, seed: int, scale_dtype=torch.float16):
    """Random GPTQ tensors of one [rows, cols] linear, zero points random (asymmetric) and stored minus one."""
    g = torch.Generator().manual_seed(seed)
    groups = cols // (group or cols)
    q = torch.randint(0, 2**bits, (cols, rows), generator=g, dtype=torch.int32)  # [I, O]
    zeros = torch.randint(0, 2**bits, (groups, rows), generator=g, dtype=torch.int32)  # [g, O]
    scales = (torch.rand(groups, rows, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    return {"q": packing_pack(q, bits, 0), "zero": packing_pack((zeros - 1) & (2**bits - 1), bits, 1),
            "scale": scales, "g_idx": torch.arange(cols, dtype=torch.int32) // (group or cols)}


def product(tensors: dict, bits: int, x: torch.Tensor, col: int = 0) -> torch.Tensor:
    """gptq_product of x [M, I] into columns [col, col + O) of a wider output -> [M, O] float64."""
    rows = tensors["scale"].shape[1]
    out = np.full((x.shape[0], col + rows + 3), np.nan, dtype=np.float32)
    gptq_product(tensors["q"].numpy(), tensors["scale"].float().numpy(), tensors["zero"].numpy(), bits,
                 x.float().numpy(), out, col)
    assert np.isnan(out[:, :col]).all() and np.isnan(out[:, col + rows:]).all()  # its columns only
    return torch.from_numpy(out[:, col: col + rows]).double()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, None], ids=["group16", "per-channel"])
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_product_equals_the_reference_dequantization_times_x(bits, group, num_rows, scale_dtype):
    tensors = random_gptq(INTER, HIDDEN, bits, group, seed=bits + num_rows, scale_dtype=scale_dtype)
    weight = reference.gptq(tensors["q"], tensors["zero"], tensors["scale"], tensors["g_idx"], bits,
                            torch.float64)  # [O, I], exact
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    want = x.double() @ weight.T  # [M, O]
    per_weight = tensors["scale"].double().repeat_interleave(HIDDEN // tensors["scale"].shape[0], 0).T  # [O, I]
    bound = 2**bits * 2e-6 * (x.double().abs() @ per_weight.T)
    got = product(tensors, bits, x, col=5)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


class GatedMath:
    """transformers' gated experts' stages (FusedExpertMath's, not transposed, no bias) over dense weights."""

    up_name = "gate_up_proj"

    def up(self, hidden, weights):
        return F.linear(hidden, weights["gate_up_proj"])

    def act(self, up):
        gate, value = up.chunk(2, dim=-1)
        return F.silu(gate) * value

    def down(self, inner, weights):
        return F.linear(inner, weights["down_proj"])


def gptq_expert(bits: int, group: int, seed: int = 0) -> tuple[dict, dict]:
    """(slot parts by name, their shapes) of one gated expert: gate and up [INTER, HIDDEN], down [HIDDEN, INTER]."""
    linears = {"gate_up_proj.0": (INTER, HIDDEN), "gate_up_proj.1": (INTER, HIDDEN), "down_proj.0": (HIDDEN, INTER)}
    parts = {}
    for number, (prefix, (rows, cols)) in enumerate(linears.items()):
        tensors = random_gptq(rows, cols, bits, group if cols % group == 0 else 8, seed + number, torch.bfloat16)
        parts |= {f"{prefix}.{role}": tensor for role, tensor in tensors.items()}
    return parts, {name: tuple(tensor.shape) for name, tensor in parts.items()}


def packed_expert(bits: int, group: int) -> tuple[dict, PackedExperts]:
    parts, shapes = gptq_expert(bits, group)
    codec = CODECS.create(gptq.METHOD, {"bits": bits, "group_size": group, "desc_act": False})
    layout = tuple(SimpleNamespace(param=name, shape=shape) for name, shape in shapes.items())
    return parts, PackedExperts(ExpertDecoder(codec, layout, torch.bfloat16), codec, shapes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("num_rows", [1, MAX_ROWS])
def test_expert_mlp_is_close_to_decode_then_mlp(bits, num_rows):
    parts, packed = packed_expert(bits, 16)
    math = GatedMath()
    rows = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights = packed(parts)  # the exact path: decoded into bf16 scratch
    exact = math.down(math.act(math.up(rows, weights)), weights)  # [n, H]
    fast = packed.mlp(math, rows, parts)
    assert fast.dtype == torch.bfloat16 and fast.shape == exact.shape
    assert (fast.float() - exact.float()).abs().max() <= 0.02 * exact.float().abs().max()
    assert not torch.equal(fast, exact)  # computed from the packed bytes, not from the decoded weights


def test_more_rows_than_max_rows_take_the_exact_path():
    parts, packed = packed_expert(4, 16)
    math = GatedMath()
    rows = torch.randn(MAX_ROWS + 1, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weights = packed(parts)
    assert torch.equal(packed.mlp(math, rows, parts), math.down(math.act(math.up(rows, weights)), weights))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, None], ids=["group16", "per-channel"])
def test_gptq_layout_decodes_to_the_compressed_tensors_weights(bits, group):
    """`quantize --layout gptq` writes the integers and scales of the default layout, packed GPTQ's way."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(bits)).to(torch.bfloat16)
    decoded = {}
    for layout in ("compressed-tensors", "gptq"):
        scheme = IntScheme(bits, group, layout)
        codec = codec_for(SimpleNamespace(quantization_config=scheme.quantization_config()))
        suffixes = scheme.suffixes((48, 64), torch.bfloat16)
        tensors = {suffix: quantize(weight, scheme, suffix) for suffix in suffixes}
        assert {s: (tuple(t.shape), t.dtype) for s, t in tensors.items()} == suffixes
        decoded[layout] = codec.decode_dense({role: tensors[end] for role, end in codec.roles.items()},
                                             torch.bfloat16)
    assert torch.equal(decoded["gptq"], decoded["compressed-tensors"])


def test_a_linear_whose_gptq_tensors_disagree_is_refused_before_the_kernel_reads_it():
    _, shapes = gptq_expert(4, 16)
    codec = CODECS.create(gptq.METHOD, {"bits": 4, "group_size": 16, "desc_act": False})
    decoder = ExpertDecoder(codec, tuple(SimpleNamespace(param=n, shape=s) for n, s in shapes.items()), torch.bfloat16)
    shapes["down_proj.0.scale"] = (4, HIDDEN + 8)  # more output columns than its qweight has
    with pytest.raises(CheckpointError, match=r"expert linear down_proj\.0 do not agree"):
        PackedExperts(decoder, codec, shapes)
