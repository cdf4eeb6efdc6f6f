"""Quantizing one dense linear weight [O, I] into symmetric integer layouts (what `moestream quantize`
writes; `compressed_tensors.py` and `gptq.py` decode them): scale = absmax of each group of G inputs /
((2**b - 1) / 2), in the weight's dtype; q = clamp(round(w / scale), -2**(b-1), 2**(b-1) - 1), laid out as
- "compressed-tensors" (the default): int4 packed along I ("pack-quantized": weight_packed [O, I/8],
  weight_scale [O, I/G], weight_shape); int8 as it is ("int-quantized": weight, weight_scale);
- "gptq" (checkpoint_format "gptq", desc_act false, sym): qweight [I/(32/b), O] packed along I, scales
  [I/G, O], qzeros [I/G, O/(32/b)] (2**(b-1) - 1 each: GPTQ stores zero - 1), g_idx [I]; its words run
  along the outputs, as the `packed-cpu` kernel reads them. Knows no checkpoint, family or runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError
from moestream.quant import compressed_tensors, gptq, packing

LAYOUTS = ("compressed-tensors", "gptq")


@dataclass(frozen=True)
class IntScheme:
    """A symmetric integer weight-only scheme: bits, inputs per scale (None: per channel), layout (LAYOUTS)."""

    bits: int
    group_size: int | None
    layout: str = "compressed-tensors"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise MoestreamError(f"unknown quantized layout {self.layout!r}; choose from {', '.join(LAYOUTS)}")

    @property
    def format(self) -> str:
        """compressed-tensors' format of these experts (the compressed-tensors layout)."""
        return compressed_tensors.PACKED if self.bits < 8 else compressed_tensors.INT

    def groups(self, inputs: int) -> int:
        """Scales per output row for `inputs` columns; MoestreamError if G does not divide them."""
        size = self.group_size or inputs
        if inputs % size:
            raise MoestreamError(f"--group-size {size} does not divide the experts' input width {inputs}")
        return inputs // size

    def suffixes(self, shape: tuple[int, int], dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors one [O, I] linear is written as: disk suffix -> (shape, dtype)."""
        rows, cols = shape
        if self.layout == "gptq":
            per_word, groups = packing.per_word(self.bits), self.groups(cols)
            if rows % per_word or cols % per_word:
                raise MoestreamError(f"quantize --layout gptq: the experts' widths {rows} and {cols} cannot be "
                                     f"packed {per_word} to a word")
            words = (groups, rows // per_word)
            return dict(qweight=((cols // per_word, rows), torch.int32), qzeros=(words, torch.int32),
                        scales=((groups, rows), dtype), g_idx=((cols,), torch.int32))
        scale = (rows, self.groups(cols))
        if self.format == compressed_tensors.PACKED:
            return {"weight_packed": ((rows, cols // packing.per_word(self.bits)), torch.int32),
                    "weight_scale": (scale, dtype), "weight_shape": ((2,), torch.int64)}
        return {"weight": (shape, torch.int8), "weight_scale": (scale, dtype)}

    def quantization_config(self) -> dict:
        """The config.json field that declares these experts (transformers and vLLM read it)."""
        if self.layout == "gptq":
            return dict(quant_method=gptq.METHOD, bits=self.bits, group_size=self.group_size or -1, desc_act=False,
                        sym=True, checkpoint_format="gptq")
        weights = dict(num_bits=self.bits, type="int", symmetric=True, dynamic=False, actorder=None,
                       strategy="group" if self.group_size else "channel", group_size=self.group_size,
                       observer="minmax")
        group = dict(targets=["re:.*experts.*"], weights=weights, input_activations=None,
                     output_activations=None, format=self.format)
        return dict(quant_method=compressed_tensors.METHOD, format=self.format, quantization_status="compressed",
                    config_groups={"group_0": group}, ignore=["lm_head"], kv_cache_scheme=None)


def quantize(weight: torch.Tensor, scheme: IntScheme, suffix: str) -> torch.Tensor:
    """The tensor `suffix` (e.g. "weight_packed") of one linear weight [O, I] quantized by `scheme`."""
    rows, cols = weight.shape
    half = 1 << (scheme.bits - 1)
    if suffix == "weight_shape":
        return torch.tensor([rows, cols], dtype=torch.int64)
    if suffix == "g_idx":
        return torch.arange(cols, dtype=torch.int32) // (scheme.group_size or cols)
    if suffix == "qzeros":  # zero point 2**(b-1) everywhere, stored minus one
        return packing.pack(torch.full((scheme.groups(cols), rows), half - 1), scheme.bits, dim=1)
    absmax = weight.float().abs().view(rows, scheme.groups(cols), -1).amax(-1)  # [O, g]
    scale = (absmax / ((2**scheme.bits - 1) / 2)).to(weight.dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # [O, g] in weight's dtype
    if suffix in ("weight_scale", "scales"):
        return scale if suffix == "weight_scale" else scale.T.contiguous()
    grouped = weight.float().view(rows, scale.shape[1], -1) / scale.float().unsqueeze(-1)  # [O, g, G]
    ints = grouped.round_().clamp_(-half, half - 1).view(rows, cols).to(torch.int32)
    if suffix == "weight":
        return ints.to(torch.int8)
    if suffix == "qweight":
        return packing.pack((ints + half).T, scheme.bits, dim=0)  # [I / (32 / b), O]
    return packing.pack(ints + half, scheme.bits, dim=1)
