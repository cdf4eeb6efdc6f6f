"""Quantizing one dense linear weight [O, I] into compressed-tensors' symmetric integer layouts (what
`moestream quantize` writes; `compressed_tensors.py` decodes them): scale = absmax of each group of G
inputs / ((2**b - 1) / 2), in the weight's dtype; q = clamp(round(w / scale), -2**(b-1), 2**(b-1) - 1).
int4 is packed ("pack-quantized": weight_packed, weight_scale, weight_shape); int8 stays int8
("int-quantized": weight, weight_scale). Knows no checkpoint, family or runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError
from moestream.quant import packing
from moestream.quant.compressed_tensors import INT, METHOD, PACKED


@dataclass(frozen=True)
class IntScheme:
    """A symmetric integer weight-only scheme: bits per weight and inputs per scale (None: per channel)."""

    bits: int
    group_size: int | None

    @property
    def format(self) -> str:
        return PACKED if self.bits < 8 else INT

    def groups(self, inputs: int) -> int:
        """Scales per output row for `inputs` columns; MoestreamError if G does not divide them."""
        size = self.group_size or inputs
        if inputs % size:
            raise MoestreamError(f"--group-size {size} does not divide the experts' input width {inputs}")
        return inputs // size

    def suffixes(self, shape: tuple[int, int], dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors one [O, I] linear is written as: disk suffix -> (shape, dtype)."""
        rows, cols = shape
        scale = (rows, self.groups(cols))
        if self.format == PACKED:
            return {"weight_packed": ((rows, cols // packing.per_word(self.bits)), torch.int32),
                    "weight_scale": (scale, dtype), "weight_shape": ((2,), torch.int64)}
        return {"weight": (shape, torch.int8), "weight_scale": (scale, dtype)}

    def quantization_config(self) -> dict:
        """The config.json field that declares these experts (transformers and vLLM read it)."""
        weights = dict(num_bits=self.bits, type="int", symmetric=True, dynamic=False, actorder=None,
                       strategy="group" if self.group_size else "channel", group_size=self.group_size,
                       observer="minmax")
        group = dict(targets=["re:.*experts.*"], weights=weights, input_activations=None,
                     output_activations=None, format=self.format)
        return dict(quant_method=METHOD, format=self.format, quantization_status="compressed",
                    config_groups={"group_0": group}, ignore=["lm_head"], kv_cache_scheme=None)


def quantize(weight: torch.Tensor, scheme: IntScheme, suffix: str) -> torch.Tensor:
    """The tensor `suffix` (e.g. "weight_packed") of one linear weight [O, I] quantized by `scheme`."""
    rows, cols = weight.shape
    if suffix == "weight_shape":
        return torch.tensor([rows, cols], dtype=torch.int64)
    scale = _scale(weight, scheme)  # [O, g] in weight's dtype
    if suffix == "weight_scale":
        return scale
    half = 1 << (scheme.bits - 1)
    grouped = weight.float().view(rows, scale.shape[1], -1) / scale.float().unsqueeze(-1)  # [O, g, G]
    ints = grouped.round_().clamp_(-half, half - 1).view(rows, cols).to(torch.int32)
    if suffix == "weight":
        return ints.to(torch.int8)
    return packing.pack(ints + half, scheme.bits, dim=1)


def _scale(weight: torch.Tensor, scheme: IntScheme) -> torch.Tensor:
    rows, cols = weight.shape
    absmax = weight.float().abs().view(rows, scheme.groups(cols), -1).amax(-1)  # [O, g]
    scale = (absmax / ((2**scheme.bits - 1) / 2)).to(weight.dtype)
    return torch.where(scale > 0, scale, torch.ones_like(scale))
