"""compressed-tensors' integer weight layouts (llm-compressor's output, vLLM's W4A16/W8A16 loader):
- "pack-quantized": `weight_packed` int32 [O, I / (32 / b)] (b-bit values + 2**(b-1), first in the
  lowest bits), `weight_scale` [O, I / G] (G: group size; I for per channel), `weight_zero_point`
  when asymmetric (int32 [O / (32 / b), I / G] packed along O the same way), `weight_shape` [2];
- "int-quantized": `weight` int8 [O, I], `weight_scale` [O, I / G], `weight_zero_point` (int8 [O, I / G]).
A weight is (q - zero_point) * scale, group by group along I; activations stay in the compute dtype.
Knows no family or runtime."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moestream.errors import CheckpointError
from moestream.quant import packing
from moestream.quant.codec import CODECS
from moestream.quant.linears import LinearCodec

METHOD = "compressed-tensors"
PACKED = "pack-quantized"
INT = "int-quantized"


@CODECS.register(METHOD)
class CompressedTensorsCodec(LinearCodec):
    """Integer weight-only experts in compressed-tensors' pack-quantized or int-quantized format."""

    method, marker = METHOD, "scale"

    def __init__(self, quantization_config: Mapping[str, Any]):
        groups = list((quantization_config.get("config_groups") or {}).values())
        if len(groups) != 1 or not isinstance(groups[0], Mapping) or not isinstance(groups[0].get("weights"), Mapping):
            raise CheckpointError(f"{METHOD}: only one config group of quantized weights is supported, "
                                  f"the checkpoint has {len(groups)}")
        weights, fmt = dict(groups[0]["weights"]), groups[0].get("format") or quantization_config.get("format")
        if fmt not in (PACKED, INT) or weights.get("type", "int") != "int" or groups[0].get("input_activations"):
            raise CheckpointError(f"{METHOD}: format {fmt!r} with {weights.get('type')} weights and activations "
                                  f"{groups[0].get('input_activations')!r} is not supported; supported: "
                                  f"{PACKED} and {INT} integer weights (W4A16, W8A16)")
        self.format, self.bits = fmt, int(weights.get("num_bits", 4))
        self.symmetric = bool(weights.get("symmetric", True))
        if self.format == PACKED:
            packing.per_word(self.bits)
        if weights.get("actorder") not in (None, False) and weights.get("actorder") != "weight":
            raise CheckpointError(f"{METHOD}: activation-ordered groups (actorder {weights['actorder']!r}) are not supported")

    @property
    def roles(self) -> dict[str, str]:
        """Slot role -> disk suffix of each quantized tensor of one linear."""
        names = {"q": "weight_packed" if self.format == PACKED else "weight", "scale": "weight_scale"}
        return (names | ({} if self.symmetric else {"zero": "weight_zero_point"})
                | ({"shape": "weight_shape"} if self.format == PACKED else {}))

    def linear_shape(self, layout, prefix: str) -> tuple[int, int]:
        rows, cols = layout[f"{prefix}.q"]
        return rows, cols * (packing.per_word(self.bits) if self.format == PACKED else 1)

    def decode_linear(self, parts, prefix: str, target: torch.Tensor) -> int:
        q, scale = parts[f"{prefix}.q"], parts[f"{prefix}.scale"]
        rows = q.shape[0]
        zeros = None if (zero := parts.get(f"{prefix}.zero")) is None else self.zero_points(zero, rows)  # [O, I/G]
        if self.format == PACKED and self.bits == 4:
            packing.scaled_nibbles(q, scale, zeros, target[:rows], packing.nibble_table)
            return rows
        ints = q if self.format == INT else packing.unpack(q, self.bits, dim=1) - (1 << (self.bits - 1))  # [O, I]
        if zeros is not None:
            ints = ints - zeros.repeat_interleave(ints.shape[1] // zeros.shape[1], dim=1)
        packing.scaled(ints, scale, target[:rows])
        return rows

    def zero_points(self, zero: torch.Tensor, rows: int) -> torch.Tensor:
        """A linear's stored zero points -> [O, I / G] int32, signed (the format's offset taken off)."""
        if self.format == INT or zero.dtype != torch.int32:
            return zero.to(torch.int32)
        return (packing.unpack(zero, self.bits, dim=0) - (1 << (self.bits - 1)))[:rows]
