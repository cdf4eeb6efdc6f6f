"""make-model's quantized checkpoints, one `QuantLayout` per format in `QUANT_LAYOUTS` (by `--quant` name):
which disk tensors the format stores quantized, as which tensors, and the config's `quantization_config`, as
the format's published checkpoints have them. A quantized tensor's values are the encoding of the dense
tensor it replaces (seeded by its name), re-drawn for each of its disk tensors so they stay independent (any
order, any worker). Knows no family by name and nothing of the runtime."""

from __future__ import annotations

import math
import re
from typing import ClassVar

import torch

from moestream.checkpoint.spec import ModelSpec
from moestream.checkpoint.writer import Fill, TensorPlan
from moestream.quant import fp8, mxfp4
from moestream.quant.encode import IntScheme, quantize
from moestream.registry import Registry


class QuantLayout:
    """One format: `pattern` names the dense tensors it quantizes; `planned` and `encode` give the same disk tensors."""

    pattern: ClassVar[str]  # re.search on a dense disk tensor's name

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def quantization_config(self) -> dict:
        raise NotImplementedError

    def quantizes(self, tensor: TensorPlan) -> bool:
        return tensor.dtype.is_floating_point and re.search(self.pattern, tensor.name) is not None

    def planned(self, tensor: TensorPlan) -> tuple[TensorPlan, ...]:
        """The disk tensors (name, shape, dtype) that replace the dense `tensor`."""
        raise NotImplementedError

    def encode(self, tensor: TensorPlan, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The dense tensor's values -> the values of each of `planned(tensor)`."""
        raise NotImplementedError


QUANT_LAYOUTS: Registry[QuantLayout] = Registry("quantized checkpoint format")


def quantize_units(layout: QuantLayout, units: list[list[TensorPlan]],
                   fill: Fill) -> tuple[list[list[TensorPlan]], Fill]:
    """The units' disk tensors, the format's in place of those it quantizes, and the fill that gives their values."""
    replaced = {tensor.name: layout.planned(tensor) for unit in units for tensor in unit if layout.quantizes(tensor)}
    planned_units = [[plan for tensor in unit for plan in replaced.get(tensor.name, (tensor,))] for unit in units]
    # disk name -> (dense tensor, which of its disk tensors)
    sources = {plan.name: (tensor, i) for unit in units for tensor in unit
               for i, plan in enumerate(replaced.get(tensor.name, ()))}

    def quantized(tensor: TensorPlan) -> torch.Tensor:
        if tensor.name not in sources:
            return fill(tensor)
        dense, index = sources[tensor.name]
        return layout.encode(dense, fill(dense))[index].contiguous()

    return planned_units, quantized


@QUANT_LAYOUTS.register("mxfp4")
class Mxfp4Layout(QuantLayout):
    """GPT-OSS's release: each layer's fused experts [E, A, B] as `_blocks` uint8 [E, B, A/32, 16] and `_scales`
    uint8 [E, B, A/32] (groups of 32 along A); attention, router, embeddings, head and biases as they are."""

    pattern = r"\.mlp\.experts\.(gate_up_proj|down_proj)$"

    def quantization_config(self) -> dict:
        return {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}

    def planned(self, tensor: TensorPlan) -> tuple[TensorPlan, ...]:
        experts, inner, outer = tensor.shape  # the model's [E, A, B]: B rows of A values on disk
        groups = inner // mxfp4.GROUP
        return (TensorPlan(tensor.name + mxfp4.BLOCKS, (experts, outer, groups, mxfp4.GROUP // 2), torch.uint8),
                TensorPlan(tensor.name + mxfp4.SCALES, (experts, outer, groups), torch.uint8))

    def encode(self, tensor: TensorPlan, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return mxfp4.encode(values.transpose(-1, -2))


@QUANT_LAYOUTS.register("fp8")
class Fp8Layout(QuantLayout):
    """DeepSeek-V3's release (and the FP8 ones of DeepSeek-V3.2, GLM, Qwen3.x and MiniMax-M2): every linear weight of
    the decoder layers (whatever their names: q_proj, wq_b, w1) float8_e4m3fn with float32 `weight_scale_inv` per
    128 x 128 block, except routers, Qwen's shared-expert gate and linear-attention decay inputs and the indexer's
    head weights (`kept`); embeddings, norms, the head, towers and MTP layers (outside the decoder) as they are."""

    # a decoder layer's linear weight, of a text model ("model.layers.N.") or of a multimodal model's
    # language model ("model.language_model.layers.N."); group 1 is the linear's own name
    pattern = r"^model\.(?:language_model\.)?layers\.\d+\.(?:\w+\.)*?(\w+)\.weight$"
    kept = frozenset({"gate", "router", "shared_expert_gate", "in_proj_a", "in_proj_b", "in_proj_ba", "weights_proj"})
    block = fp8.DEFAULT_BLOCK

    def quantization_config(self) -> dict:
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(self.block)}

    def quantizes(self, tensor: TensorPlan) -> bool:
        if len(tensor.shape) != 2 or not super().quantizes(tensor):
            return False
        return re.search(self.pattern, tensor.name).group(1) not in self.kept

    def planned(self, tensor: TensorPlan) -> tuple[TensorPlan, ...]:
        scale_name = tensor.name.removesuffix(fp8.WEIGHT) + fp8.SCALE
        return (TensorPlan(tensor.name, tensor.shape, fp8.FP8),
                TensorPlan(scale_name, fp8.scale_grid(tensor.shape, self.block), torch.float32))

    def encode(self, tensor: TensorPlan, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fp8.encode(values, self.block)


@QUANT_LAYOUTS.register("w4a16")
class W4a16Layout(QuantLayout):
    """llm-compressor's W4A16 (compressed-tensors "pack-quantized"): each routed expert linear symmetric, in groups of
    G = 128 inputs (the largest divisor of 128 dividing the expert widths, in narrower test models)."""

    pattern = r"\.experts\.\d+\.\w+\.weight$"
    group_size = 128

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.scheme = IntScheme(4, math.gcd(self.group_size, spec.hidden_size, spec.intermediate_size))

    def quantization_config(self) -> dict:
        return self.scheme.quantization_config()

    def planned(self, tensor: TensorPlan) -> tuple[TensorPlan, ...]:
        stem = tensor.name.removesuffix("weight")
        return tuple(TensorPlan(stem + suffix, shape, dtype)
                     for suffix, (shape, dtype) in self._suffixes(tensor).items())

    def encode(self, tensor: TensorPlan, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(quantize(values, self.scheme, suffix) for suffix in self._suffixes(tensor))

    def _suffixes(self, tensor: TensorPlan) -> dict:
        return self.scheme.suffixes(tensor.shape, tensor.dtype)
