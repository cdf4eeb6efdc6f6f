"""Decoding right before an expert's MLP: `ExpertDecoder` owns one set of dense scratch tensors (the
shapes the codec gives for the slot layout, in the compute dtype, on the compute device), allocated
once and rewritten for every expert, so that no dequantized copy of a layer ever exists. On CUDA the
decode and the MLP that reads the scratch run in order on the compute stream, so the next decode
cannot overwrite weights still being read. Knows no store, policy or family.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from moestream.quant.codec import ExpertCodec, Tensors


class Part(Protocol):
    """What the decoder reads of one part of the slot layout (the checkpoint's `PartView` is one)."""

    @property
    def param(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


class ExpertDecoder:
    """Turns one expert's slot views into the dense weights its ExpertMath reads (valid until the next call)."""

    def __init__(self, codec: ExpertCodec, layout: Sequence[Part], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.codec = codec
        shapes = codec.dense_shapes({p.param: p.shape for p in layout})
        self.scratch = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in shapes.items()}

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.scratch.values())

    def __call__(self, parts: Tensors) -> Tensors:
        return self.codec.decode(parts, self.scratch)
