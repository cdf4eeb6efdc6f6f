"""MXFP4 experts decode as transformers dequantizes the same bytes (its `convert_moe_packed_tensors`)."""

import pytest
import torch
from safetensors import safe_open
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from moestream.checkpoint.index import build_index
from moestream.checkpoint.make_model import make_config
from moestream.checkpoint.spec import ModelSpec
from moestream.errors import CheckpointError
from moestream.families import FAMILIES
from moestream.quant import codec_for
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.mxfp4 import decode, encode
from moestream.topology import ExpertKey
from tests.quant.slots import disk_tensor, read_slot


@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoint):
    return tiny_checkpoint("gpt_oss", num_layers=2, quant="mxfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_equals_transformers_on_random_bytes(dtype):
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=generator, dtype=torch.uint8)  # [E, R, G, 16]
    scales = torch.randint(110, 135, (3, 40, 4), generator=generator, dtype=torch.uint8)  # [E, R, G]
    assert torch.equal(decode(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_encode_is_exact_on_representable_values_and_nearest_otherwise():
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=generator)
    exponents = torch.randint(-8, 3, (8, 2, 1), generator=generator).float()
    exact = (torch.tensor(FP4_VALUES)[codes].view(8, 2, 32) * torch.exp2(exponents)).view(8, 64)
    exact[:, ::32] = 6.0 * torch.exp2(exponents[:, :, 0])  # each group's largest magnitude sets its scale
    assert torch.equal(decode(*encode(exact), torch.float32).T, exact)
    noisy = torch.randn(8, 64, generator=generator)
    blocks, scales = encode(noisy)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)  # the scale of each value
    assert torch.all((decode(blocks, scales, torch.float32).T - noisy).abs() <= step)  # half of e2m1's widest gap


def test_slots_hold_the_quantized_tensors_and_decode_as_transformers(gpt_oss):
    checkpoint = build_index(gpt_oss)
    decoder = ExpertDecoder(checkpoint.codec, checkpoint.experts.layout, torch.float32)
    block = checkpoint.blocks[1]
    for expert in (0, 5):
        weights = decoder(checkpoint.experts.views(read_slot(checkpoint, ExpertKey(1, expert))))
        for proj in ("gate_up_proj", "down_proj"):
            name = f"{block.disk_prefix}.experts.{proj}"
            reference = convert_moe_packed_tensors(disk_tensor(gpt_oss, name + "_blocks"),
                                                   disk_tensor(gpt_oss, name + "_scales"), dtype=torch.float32)
            assert torch.equal(weights[proj], reference[expert])
            assert torch.equal(weights[proj + "_bias"], disk_tensor(gpt_oss, name + "_bias")[expert])


def test_an_expert_is_its_quantized_bytes(gpt_oss):
    checkpoint = build_index(gpt_oss)
    prefix = f"{checkpoint.blocks[0].disk_prefix}.experts."
    with safe_open(gpt_oss / "model.safetensors", "pt") as shard:
        names = [name for name in shard.keys() if name.startswith(prefix)]
        per_expert = sum(_nbytes(shard, name) for name in names) // 8
    assert sorted(n.removeprefix(prefix) for n in names) == sorted(
        ["gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales",
         "down_proj_bias"])
    assert checkpoint.topology.expert_bytes == per_expert == 64 * 64 * 2 * 17 // 32 + 64 * 64 * 17 // 32 + 192 * 4
    assert {view.dtype for view in checkpoint.experts.layout} == {torch.uint8, torch.float32}


def _nbytes(shard, name: str) -> int:
    tensor = shard.get_tensor(name)
    return tensor.numel() * tensor.element_size()


def test_per_expert_tensors_are_refused_naming_the_layout():
    codec = codec_for(type("Config", (), {"quantization_config": {"quant_method": "mxfp4"}})())
    with pytest.raises(CheckpointError, match="fused over experts"):
        codec.disk_parts(FAMILIES.create("mixtral").expert_parts(make_config(ModelSpec("mixtral"))))
