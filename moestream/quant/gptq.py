"""GPTQ's layout (AutoGPTQ / GPTQModel checkpoint_format "gptq", desc_act false), per linear [O, I]: `qweight` int32
[I / (32 / b), O] (b-bit values packed along I, first in the lowest bits), `qzeros` int32 [I / G, O / (32 / b)]
(packed along O, each stored as zero - 1), `scales` [I / G, O], `g_idx` int32 [I] (i // G without act-order):
Weight[o, i] = scales[g, o] * (q[i, o] - ((qzeros[g, o] + 1) mod 2**b)), g = g_idx[i]. Knows no family or runtime."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moestream.errors import CheckpointError
from moestream.quant import packing
from moestream.quant.codec import CODECS
from moestream.quant.linears import LinearCodec

METHOD = "gptq"
ROLES = {"q": "qweight", "zero": "qzeros", "scale": "scales", "g_idx": "g_idx"}


@CODECS.register(METHOD)
class GptqCodec(LinearCodec):
    """Integer weight-only experts in GPTQ's qweight/qzeros/scales/g_idx layout."""

    method, marker, roles = METHOD, "q", ROLES

    def __init__(self, quantization_config: Mapping[str, Any]):
        self.bits = int(quantization_config.get("bits", 4))
        fmt = quantization_config.get("checkpoint_format", "gptq")
        if quantization_config.get("desc_act") or fmt != "gptq" or self.bits not in (4, 8):
            raise CheckpointError(f"{METHOD}: bits {self.bits}, desc_act {quantization_config.get('desc_act')!r}, "
                                  f"checkpoint_format {fmt!r} is not supported; supported: 4 or 8 bits, desc_act "
                                  "false, checkpoint_format 'gptq'")

    def linear_shape(self, layout, prefix: str) -> tuple[int, int]:
        packed_in, rows = layout[f"{prefix}.q"]
        return rows, packed_in * packing.per_word(self.bits)

    def decode_linear(self, parts, prefix: str, target: torch.Tensor) -> int:
        q = packing.unpack(parts[f"{prefix}.q"], self.bits, dim=0)  # [I, O]
        rows = q.shape[1]
        zeros = (packing.unpack(parts[f"{prefix}.zero"], self.bits, dim=1)[:, :rows] + 1) & ((1 << self.bits) - 1)
        ints = q.T - zeros.T.repeat_interleave(q.shape[0] // zeros.shape[0], dim=1)  # [O, I]; zeros [I/G, O]
        packing.scaled(ints, parts[f"{prefix}.scale"].T, target[:rows])
        return rows
