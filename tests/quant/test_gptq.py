import pytest
import torch

from moestream.errors import CheckpointError
from moestream.quant import CODECS
from tests.quant import reference
from tests.quant.test_compressed_tensors import PARTS, packing_pack


def gptq_linear(rows, cols, bits, group, seed):
    """Random GPTQ tensors of one [rows, cols] linear: qweight [cols/p, rows], qzeros [cols/G, rows/p],
    scales [cols/G, rows] fp16, g_idx [cols]."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 2**bits, (cols, rows), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 2**bits, (cols // group, rows), generator=g, dtype=torch.int32)
    scales = (torch.rand(cols // group, rows, generator=g) * 0.02 + 1e-3).to(torch.float16)
    g_idx = torch.arange(cols, dtype=torch.int32) // group
    return packing_pack(ints, bits, 0), packing_pack(zeros, bits, 1), scales, g_idx


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_equals_autogptq_reference(bits, dtype):
    codec = CODECS.create("gptq", {"quant_method": "gptq", "bits": bits, "group_size": 8, "desc_act": False})
    inter, hidden = 16, 32
    parts, want = {}, {}
    for j, (param, index, rows, cols) in enumerate([("gate_up_proj", 0, inter, hidden), ("gate_up_proj", 1, inter, hidden),
                                                    ("down_proj", 0, hidden, inter)]):
        q, z, s, g_idx = gptq_linear(rows, cols, bits, 8, seed=j)
        parts |= {f"{param}.{index}.q": q, f"{param}.{index}.zero": z, f"{param}.{index}.scale": s,
                  f"{param}.{index}.g_idx": g_idx}
        want.setdefault(param, []).append(reference.gptq(q, z, s, g_idx, bits, dtype))
    shapes = codec.dense_shapes({name: tuple(t.shape) for name, t in parts.items()})
    assert shapes == {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    got = codec.decode(parts, {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()})
    for param, pieces in want.items():
        assert torch.equal(got[param], torch.cat(pieces))


def test_disk_parts_are_gptq_names():
    codec = CODECS.create("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})
    names = {p.param: p.disk for p in codec.disk_parts(PARTS)}
    assert names["gate_up_proj.1.q"] == ("experts.{expert}.w3.qweight",)
    assert names["down_proj.0.zero"] == ("experts.{expert}.w2.qzeros",)


@pytest.mark.parametrize("config", [{"desc_act": True}, {"bits": 3}, {"checkpoint_format": "gptq_v2"}])
def test_unsupported_variants_are_refused(config):
    with pytest.raises(CheckpointError, match="gptq: .* supported: "):
        CODECS.create("gptq", {"quant_method": "gptq", "bits": 4, "desc_act": False} | config)
