"""`packed-cpu` on the layouts stored by output row (quant/packed_rows.py through quant/packed_formats.py):
compressed-tensors int4 and int8 (packed or not, symmetric or not), FP8 block (partial blocks, per tensor,
ue8m0 scales) and MXFP4 with biases. Each linear's product from the stored bytes against the codec's own
float32 decoding times x in float64, and one expert's MLP against decode-then-MLP in bf16.

Tolerances, stated: every weight the loops use is the float32 decode's exactly (a small integer or an FP8 /
e2m1 value times its scale); the sums run in float32 in another order, so each output stays within 1e-5 of
sum_i |x_i w_i|. The MLP within 2% of the exact path's largest output (which rounds each weight to bf16). A
wrong nibble, group, block, scale or zero point is off by about |w x| per output: far outside both."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moestream.errors import CheckpointError
from moestream.quant import CODECS, fp8, mxfp4
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.packed_formats import PackedExperts, covers
from tests.quant.test_compressed_tensors import ct_config, random_linear

INTER, HIDDEN, GROUP = 40, 64, 16
GATED = {"gate_up_proj.0": (INTER, HIDDEN), "gate_up_proj.1": (INTER, HIDDEN), "down_proj.0": (HIDDEN, INTER)}


def ct_expert(config: dict, seed: int) -> dict:
    codec = CODECS.create("compressed-tensors", config)
    packed = codec.format == "pack-quantized"
    parts = {}
    for number, (prefix, (rows, cols)) in enumerate(GATED.items()):
        group = GROUP if cols % GROUP == 0 else 8  # the down projection's 40 inputs: groups of 8
        q, scale, zero = random_linear(rows, cols, codec.bits, group, codec.symmetric, packed, seed + number)
        parts |= {f"{prefix}.q": q, f"{prefix}.scale": scale}
        parts |= {} if zero is None else {f"{prefix}.zero": zero}
        parts |= {f"{prefix}.shape": torch.tensor([rows, cols])} if packed else {}
    return parts


def fp8_expert(config: dict, seed: int) -> dict:
    codec, g = CODECS.create("fp8", config), torch.Generator().manual_seed(seed)
    parts = {}
    for prefix, shape in GATED.items():
        weight, scale = fp8.encode(torch.randn(shape, generator=g) * 0.05, codec.block)
        if config.get("scale_fmt") == "ue8m0":  # scales as e8m0 bytes: powers of two
            scale = (torch.log2(scale).ceil() + 127).to(torch.uint8)
        parts |= {f"{prefix}.weight": weight, f"{prefix}.weight_scale_inv": scale}
    return parts


def mxfp4_expert(config: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    parts = {}
    for param, (outs, ins) in {"gate_up_proj": (2 * HIDDEN, HIDDEN), "down_proj": (HIDDEN, HIDDEN)}.items():
        blocks, scales = mxfp4.encode(torch.randn(outs, ins, generator=g) * 0.05)  # disk: [R, C / 32, 16]
        parts |= {param + mxfp4.BLOCKS: blocks, param + mxfp4.SCALES: scales,
                  f"{param}_bias": torch.randn(outs, generator=g) * 0.01}
    return parts


CASES = {
    "ct-int4": (ct_expert, ct_config(4, GROUP)),
    "ct-int4-asymmetric": (ct_expert, ct_config(4, GROUP, symmetric=False)),
    "ct-int8-packed-asymmetric": (ct_expert, ct_config(8, GROUP, symmetric=False)),
    "ct-int8": (ct_expert, ct_config(8, GROUP, fmt="int-quantized")),
    "ct-int8-asymmetric": (ct_expert, ct_config(8, GROUP, symmetric=False, fmt="int-quantized")),
    "fp8-partial-blocks": (fp8_expert, {"quant_method": "fp8", "weight_block_size": [16, 48]}),
    "fp8-per-tensor": (fp8_expert, {"quant_method": "fp8"}),
    "fp8-ue8m0": (fp8_expert, {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}),
    "mxfp4": (mxfp4_expert, {"quant_method": "mxfp4"}),
}


def expert(case: str, dtype=torch.bfloat16, seed: int = 0):
    """(slot views, packed experts, the codec's float32 decoding of them) of one expert in the case's format."""
    make, config = CASES[case]
    parts = make(config, seed)
    codec = CODECS.create(config["quant_method"], config)
    assert covers(codec)
    shapes = {name: tuple(t.shape) for name, t in parts.items()}
    layout = tuple(SimpleNamespace(param=name, shape=shape) for name, shape in shapes.items())
    exact32 = ExpertDecoder(codec, layout, torch.float32)(parts)
    exact32 = {name: w.clone() for name, w in exact32.items()}
    return parts, PackedExperts(CountedDecoder(codec, layout, dtype), codec, shapes), exact32


class CountedDecoder(ExpertDecoder):
    """An ExpertDecoder that counts its decodes."""

    calls = 0

    def __call__(self, parts):
        self.calls += 1
        return super().__call__(parts)


class Math:
    """transformers' gated experts' stages (FusedExpertMath's) over dense weights: [O, I] weights, or GPT-OSS's
    transposed [I, O] with biases."""

    def __init__(self, transposed: bool):
        self.up_name, self.transposed = "gate_up_proj", transposed

    def project(self, x, weights, name):
        weight = weights[name]
        out = x.to(weight.dtype) @ weight if self.transposed else F.linear(x.to(weight.dtype), weight)
        return out + weights[f"{name}_bias"] if self.transposed else out

    def up(self, hidden, weights):
        return self.project(hidden, weights, "gate_up_proj")

    def act(self, up):
        gate, value = up.chunk(2, dim=-1)
        return F.silu(gate) * value

    def down(self, inner, weights):
        return self.project(inner, weights, "down_proj")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_rows", [1, 5])
def test_each_product_equals_the_float32_decoding_times_x(case, num_rows):
    parts, packed, exact32 = expert(case)
    math = Math(transposed=case == "mxfp4")
    for param in ("gate_up_proj", "down_proj"):
        weight = exact32[param].double()
        inputs = weight.shape[0] if math.transposed else weight.shape[1]
        x = torch.randn(num_rows, inputs, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
        dense = weight if math.transposed else weight.T  # [in, out]
        want = x.double() @ dense + (parts[f"{param}_bias"].double() if math.transposed else 0)
        bound = 1e-5 * (x.double().abs() @ dense.abs()) + 1e-6
        got = packed.project(x, parts, param).double()
        assert got.shape == want.shape
        assert ((got - want).abs() <= bound).all(), (case, param, (got - want).abs().max())


@pytest.mark.parametrize("case", CASES)
def test_expert_mlp_is_close_to_decode_then_mlp(case):
    parts, packed, _ = expert(case)
    math = Math(transposed=case == "mxfp4")
    hidden = HIDDEN
    rows = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights = packed(parts)  # the exact path: decoded into bf16 scratch
    exact = math.down(math.act(math.up(rows, weights)), weights)
    fast = packed.mlp(math, rows, parts)
    assert packed.decoder.calls == 1  # the exact path's: the kernel computed from the stored bytes
    assert fast.dtype == torch.bfloat16 and fast.shape == exact.shape
    assert (fast.float() - exact.float()).abs().max() <= 0.02 * exact.float().abs().max()


def test_compressed_tensors_scales_that_disagree_with_the_weight_are_refused():
    parts, _, _ = expert("ct-int4")
    config = CASES["ct-int4"][1]
    codec = CODECS.create("compressed-tensors", config)
    shapes = {name: tuple(t.shape) for name, t in parts.items()}
    decoder = ExpertDecoder(codec, tuple(SimpleNamespace(param=n, shape=s) for n, s in shapes.items()),
                            torch.bfloat16)
    shapes["down_proj.0.scale"] = (HIDDEN + 8, INTER // 8)  # more output rows than its weight has
    with pytest.raises(CheckpointError, match=r"expert linear down_proj\.0 do not agree"):
        PackedExperts(decoder, codec, shapes)


def test_two_bit_words_are_not_covered():
    assert not covers(CODECS.create("compressed-tensors", ct_config(2, GROUP)))
