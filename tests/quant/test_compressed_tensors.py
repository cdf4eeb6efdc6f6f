import pytest
import torch

from moestream.errors import CheckpointError
from moestream.families.base import ExpertPart
from moestream.quant import CODECS, codec_for
from moestream.quant.encode import IntScheme, quantize
from tests.quant import reference

PARTS = (ExpertPart("gate_up_proj", ("experts.{expert}.w1.weight", "experts.{expert}.w3.weight")),
         ExpertPart("down_proj", ("experts.{expert}.w2.weight",)))


def ct_config(bits=4, group=16, symmetric=True, fmt="pack-quantized"):
    weights = dict(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group)
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt}}}


def random_linear(rows, cols, bits, group, symmetric, packed, seed):
    """Random quantized tensors of one linear, as stored: (q, scale, zero)."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 2**bits, (rows, cols), generator=g, dtype=torch.int32)
    scale = (torch.rand(rows, cols // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    zero = None
    if not symmetric:
        zints = torch.randint(0, 2**bits, (rows, cols // group), generator=g, dtype=torch.int32)
        zero = packing_pack(zints, bits, 0) if packed else (zints - 2 ** (bits - 1)).to(torch.int8)
    q = packing_pack(ints, bits, 1) if packed else (ints - 2 ** (bits - 1)).to(torch.int8)
    return q, scale, zero


def packing_pack(values, bits, dim):
    """Independent packer: value i of each word in bits [b*i, b*i + b)."""
    count = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    words = sum(moved[..., i::count] << (bits * i) for i in range(count))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim)


@pytest.mark.parametrize("bits,packed", [(4, True), (8, False)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_decode_equals_reference(bits, packed, symmetric):
    fmt = "pack-quantized" if packed else "int-quantized"
    codec = codec_for(type("C", (), {"quantization_config": ct_config(bits, 16, symmetric, fmt)})())
    inter, hidden = 16, 32
    parts, want = {}, {}
    for j, (param, rows, cols) in enumerate([("gate_up_proj", inter, hidden), ("gate_up_proj", inter, hidden),
                                             ("down_proj", hidden, inter)]):
        index = j if param == "gate_up_proj" else 0
        q, scale, zero = random_linear(rows, cols, bits, 16, symmetric, packed, seed=j)
        parts |= {f"{param}.{index}.q": q, f"{param}.{index}.scale": scale}
        if zero is not None:
            parts[f"{param}.{index}.zero"] = zero
        want.setdefault(param, []).append(reference.compressed_tensors(q, scale, zero, bits, packed, torch.bfloat16))
    shapes = codec.dense_shapes({name: tuple(t.shape) for name, t in parts.items()})
    assert shapes == {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    out = {name: torch.full(shape, float("nan"), dtype=torch.bfloat16) for name, shape in shapes.items()}
    got = codec.decode(parts, out)
    for param, pieces in want.items():
        assert torch.equal(got[param], torch.cat(pieces))
        assert got[param].data_ptr() == out[param].data_ptr()  # written into the scratch


def test_disk_parts_name_each_linear_tensor():
    codec = CODECS.create("compressed-tensors", ct_config(symmetric=False))
    names = {p.param: p.disk for p in codec.disk_parts(PARTS)}
    assert names["gate_up_proj.1.q"] == ("experts.{expert}.w3.weight_packed",)
    assert names["gate_up_proj.0.zero"] == ("experts.{expert}.w1.weight_zero_point",)
    assert names["down_proj.0.shape"] == ("experts.{expert}.w2.weight_shape",)


@pytest.mark.parametrize("bits,group", [(4, 8), (4, None), (8, None), (8, 16)])
def test_quantize_then_decode_is_close_and_exact_to_reference(bits, group):
    weight = (torch.randn(24, 32, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    scheme = IntScheme(bits, group)
    tensors = {suffix: quantize(weight, scheme, suffix) for suffix in scheme.suffixes((24, 32), torch.bfloat16)}
    for suffix, (shape, dtype) in scheme.suffixes((24, 32), torch.bfloat16).items():
        assert tuple(tensors[suffix].shape) == shape and tensors[suffix].dtype == dtype
    q = tensors.get("weight_packed", tensors.get("weight"))
    got = reference.compressed_tensors(q, tensors["weight_scale"], None, bits, bits == 4, torch.bfloat16)
    step = tensors["weight_scale"].float().repeat_interleave(32 // tensors["weight_scale"].shape[1], dim=1)
    # half a step, plus the bf16 rounding of the scale (at most 2**-8 of 7.5 steps) and of the weight
    assert torch.all((got.float() - weight.float()).abs() <= step * 0.55 + weight.float().abs() * 2**-8)


@pytest.mark.parametrize("config,words", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    (ct_config(fmt="float-quantized"), "float-quantized"),
])
def test_unsupported_quantization_is_refused_naming_it(config, words):
    with pytest.raises(CheckpointError, match=words) as error:
        codec_for(type("C", (), {"quantization_config": config})())
    assert "supported" in str(error.value) and "\n" not in str(error.value)
