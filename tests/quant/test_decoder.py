"""Decoding into scratch: one set of dense tensors rewritten for every expert, and every layer kernel
computing a quantized expert from its decoding, right before its MLP."""

import dataclasses

import pytest
import torch

from moestream.checkpoint.layout import PartView
from moestream.quant import CODECS
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.encode import IntScheme, quantize
from moestream.runtime.layer_experts import LAYER_KERNELS
from tests.quant import reference
from tests.runtime.test_layer_experts import _layer

INT4, INT8 = IntScheme(4, 8), IntScheme(8, None)
ROLES = {"weight_packed": "q", "weight": "q", "weight_scale": "scale", "weight_shape": "shape"}


def quantized_expert(dense: dict[str, torch.Tensor], scheme: IntScheme = INT4) -> dict[str, torch.Tensor]:
    """Slot parts of one expert whose dense weights are `dense` ({param: [O, I]})."""
    return {f"{param}.0.{ROLES[suffix]}": quantize(weight, scheme, suffix)
            for param, weight in dense.items() for suffix in scheme.suffixes(tuple(weight.shape), weight.dtype)}


def layout(parts: dict[str, torch.Tensor]) -> tuple[PartView, ...]:
    return tuple(PartView(name, tuple(t.shape), t.dtype, 0) for name, t in parts.items())


def dequantized(parts: dict[str, torch.Tensor], param: str) -> torch.Tensor:
    q = parts[f"{param}.0.q"]
    packed = q.dtype == torch.int32
    return reference.compressed_tensors(q, parts[f"{param}.0.scale"], None, 4 if packed else 8, packed, torch.float32)


def test_every_expert_is_decoded_into_the_same_scratch():
    generator = torch.Generator().manual_seed(0)
    experts = [quantized_expert({"up": torch.randn(16, 8, generator=generator)}) for _ in range(2)]
    decoder = ExpertDecoder(CODECS.create("compressed-tensors", INT4.quantization_config()), layout(experts[0]),
                            torch.float32)
    assert decoder.scratch_bytes == 16 * 8 * 4  # one dense expert, not a layer
    addresses = set()
    for parts in experts:
        weights = decoder(parts)
        assert torch.equal(weights["up"], dequantized(parts, "up"))
        addresses.add(weights["up"].data_ptr())
    assert len(addresses) == 1


class QuantizedMath:
    """The stand-in `ExpertMath` of test_layer_experts over [out, in] weights (as dense linears are stored)."""

    def up(self, hidden, weights):
        return hidden @ weights["up"].T

    def act(self, up):
        return up.relu()

    def down(self, inner, weights):
        return inner @ weights["down"].T

    def post(self, out):
        return out


@pytest.mark.parametrize("kernel", LAYER_KERNELS.names())
def test_every_kernel_computes_quantized_experts_from_their_decoding(kernel):
    rows, dense, spans = _layer()
    experts = [quantized_expert({"up": e["up"].T.contiguous(), "down": e["down"].T.contiguous()}, INT8) for e in dense]
    codec = CODECS.create("compressed-tensors", INT8.quantization_config())
    rows = dataclasses.replace(rows, math=QuantizedMath(),
                               decode=ExpertDecoder(codec, layout(experts[0]), torch.float32))
    layer = LAYER_KERNELS.create(kernel, rows)
    for parts, span in zip(experts, spans):
        layer.add(parts, *span)
    layer.flush()
    result = layer.result()
    for parts, (start, end) in zip(experts, spans):
        up, down = dequantized(parts, "up"), dequantized(parts, "down")
        expected = (rows.inputs[start:end] @ up.T).relu() @ down.T * rows.scale[start:end]
        assert torch.equal(result[rows.order[start:end]], expected)
