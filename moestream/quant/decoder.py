"""Decoding right before an expert's MLP: `ExpertDecoder` owns one set of dense scratch tensors (compute
dtype and device), allocated once and rewritten for every expert, so that no dequantized copy of a layer
ever exists. On CUDA the decode and the MLP run in order on the compute stream, so the next decode cannot
overwrite weights still being read. Knows no store, policy or family."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from moestream.quant.codec import ExpertCodec, Tensors


class ExpertDecoder:
    """Turns one expert's slot views into the dense weights its ExpertMath reads (valid until the next call)."""

    def __init__(self, codec: ExpertCodec, layout: Sequence[Any], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """layout: the slot's parts, each with a `param` and a `shape` (the checkpoint's `PartView`s)."""
        self.codec = codec
        shapes = codec.dense_shapes({p.param: p.shape for p in layout})
        self.scratch = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in shapes.items()}

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.scratch.values())

    def __call__(self, parts: Tensors) -> Tensors:
        return self.codec.decode(parts, self.scratch)
