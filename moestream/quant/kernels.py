"""How quantized experts compute, by name (`EngineConfig.quant_kernel`, `--quant-kernel`):
- "exact" (the default, and the reference): each expert decoded into the compute dtype right before its
  MLP (`ExpertDecoder`), bit for bit transformers' model with the same experts dequantized;
- "packed-cpu" (quant/packed_formats.py): GPTQ, compressed-tensors int4 and int8, FP8 block and MXFP4 experts
  computed from their stored bytes on the CPU, no dense copy written; faster, not bit-identical (logged).

A kernel refuses a copy an older `moestream quantize` marked with a lower `LAYOUT_VERSION`. `quant_kernel`
refuses, in one line and before anything is loaded, a kernel asked for what it does not cover; the kernel it
returns turns the engine's `ExpertDecoder` into what the experts call (`LayerRows.decode`). Knows codecs and
the checkpoint's index, not stores, policies or the runtime."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from moestream.errors import MoestreamError
from moestream.quant import packed_formats
from moestream.quant.codec import ExpertCodec, quantization_config
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.packed_formats import PackedExperts
from moestream.registry import Registry


class QuantizedCheckpoint(Protocol):
    """What a kernel reads of a checkpoint (`checkpoint.index.CheckpointIndex`)."""

    path: Path
    config: Any  # transformers' config
    codec: ExpertCodec | None
    adapter: Any  # its family adapter: model_type, uses_experts_registry
    experts: Any  # its slot layout: experts.layout, each part's param and shape

log = logging.getLogger(__name__)
LAYOUT_KEY = "moestream_layout"
LAYOUT_VERSION = 1  # of the layouts `moestream quantize` writes: raised when a kernel needs what an older one lacks


def format_of(codec: ExpertCodec | None) -> str:
    """The experts' format in words: "gptq int4", "compressed-tensors pack-quantized int4", "mxfp4", ..."""
    if codec is None:
        return "unquantized"
    bits = getattr(codec, "bits", None)
    words = (codec.registry_name, getattr(codec, "format", None), f"int{bits}" if bits else None)
    return " ".join(word for word in words if word)


class QuantKernel:
    """A way of computing quantized experts: `covers` the formats it reads, `refusal` why it cannot run a checkpoint
    (None: it can), `__call__` what the experts call, from the engine's decoder (None for an unquantized checkpoint)."""

    registry_name: str

    def covers(self, codec: ExpertCodec | None) -> bool:
        return True

    def refusal(self, checkpoint: QuantizedCheckpoint, device: str) -> str | None:
        return None

    def __call__(self, decoder: ExpertDecoder | None, checkpoint: QuantizedCheckpoint):
        return decoder


QUANT_KERNELS: Registry[QuantKernel] = Registry("quantized expert kernel")


@QUANT_KERNELS.register("exact")
class ExactKernel(QuantKernel):
    """Decode into the compute dtype, then the MLP: every format, every device."""


@QUANT_KERNELS.register("packed-cpu")
class PackedCpuKernel(QuantKernel):
    """Experts in every format of `packed_formats.PACKED_FORMATS`, from their stored bytes, on the CPU."""

    def covers(self, codec: ExpertCodec | None) -> bool:
        return packed_formats.covers(codec)

    def refusal(self, checkpoint: QuantizedCheckpoint, device: str) -> str | None:
        codec, name = checkpoint.codec, f"--quant-kernel {self.registry_name}"
        written = (quantization_config(checkpoint.config) or {}).get(LAYOUT_KEY, LAYOUT_VERSION)
        if written < LAYOUT_VERSION:
            return (f"{name}: --model {checkpoint.path} was written by an older `moestream quantize` (layout "
                    f"{written}; this version reads {LAYOUT_VERSION}): re-run `moestream quantize` on the "
                    "unquantized checkpoint, or use --quant-kernel exact")
        if not self.covers(codec):
            return f"{name} does not cover {format_of(codec)} experts; kernels that cover them: {covering(codec)}"
        if device != "cpu":
            return f"{name} computes on the CPU, not --device {device}; kernels that cover it: exact"
        if not checkpoint.adapter.uses_experts_registry:
            return (f"{name} computes transformers' experts modules, and {checkpoint.adapter.model_type}'s are "
                    "moestream's own; kernels that cover them: exact")
        return None

    def __call__(self, decoder: ExpertDecoder | None, checkpoint: QuantizedCheckpoint) -> PackedExperts:
        log.warning("moestream: --quant-kernel %s computes the experts from their packed bytes: not bit-identical "
                    "to the exact path (--quant-kernel exact), so tokens may differ", self.registry_name)
        return PackedExperts(decoder, checkpoint.codec, {p.param: p.shape for p in checkpoint.experts.layout})


def covering(codec: ExpertCodec | None) -> str:
    """The kernels that cover a checkpoint's experts, comma separated."""
    return ", ".join(name for name in QUANT_KERNELS.names() if QUANT_KERNELS.create(name).covers(codec))


def quant_kernel(name: str, checkpoint: QuantizedCheckpoint, device: str) -> QuantKernel:
    """The kernel `name` for this checkpoint on `device`; MoestreamError, one line, where it cannot run it."""
    kernel = QUANT_KERNELS.create(name)
    if (reason := kernel.refusal(checkpoint, device)) is not None:
        raise MoestreamError(reason)
    return kernel
