"""The contract of quantized experts: an `ExpertCodec` per quantization method, registered in `CODECS`
under the method's name (`quantization_config.quant_method` of the checkpoint's config.json).

A quantized expert stays in its on-disk format in every tier: its slot is the concatenation of the parts
`disk_parts` names; right before an expert's MLP, `decode` writes the dense weights into scratch the caller
allocated once (`dense_shapes`). Quantized dense tensors are decoded once at load (docs/design.md,
"Quantized experts"). Codecs know their format only: no family, store, policy or runtime."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Protocol, Sequence

import torch

from moestream.errors import CheckpointError
from moestream.families.base import ExpertPart
from moestream.registry import Registry

Tensors = dict[str, torch.Tensor]
Shapes = dict[str, tuple[int, ...]]


class ExpertCodec(Protocol):
    """One quantization method, built with the config's `quantization_config`; CheckpointError if unsupported."""

    registry_name: ClassVar[str]  # the method name it is registered under (set by CODECS.register)

    def __init__(self, quantization_config: Mapping[str, Any]) -> None: ...

    def disk_parts(self, parts: Sequence[ExpertPart]) -> tuple[ExpertPart, ...]:
        """The family's dense parts -> one expert's quantized on-disk parts, in slot order (an unquantized part as it
        is), each part's `disk` naming its tensors with {expert}, relative to the block prefix, as `ExpertPart` does."""

    def dense_shapes(self, layout: Mapping[str, tuple[int, ...]]) -> Shapes:
        """Per-expert shapes of the quantized parts (by slot part name) -> per-expert shape of each dense
        weight that `decode` writes (by the name `ExpertMath` reads, e.g. "gate_up_proj")."""

    def decode(self, parts: Tensors, out: Tensors) -> Tensors:
        """One expert: its quantized parts (typed views of its slot, by slot part name) -> the weights
        `ExpertMath` reads: the tensors of `out` (scratch of `dense_shapes`, compute dtype) filled in
        place, plus the parts left unquantized, as they are. Must not keep references to `parts`."""

    def dense_groups(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        """Quantized dense tensors among the checkpoint's dense disk names: dense name it decodes to -> {role: disk name
        of each quantized tensor}. Names in no group load as they are; unquantized dense parts: {}."""

    def decode_dense(self, tensors: Tensors, dtype: torch.dtype) -> torch.Tensor:
        """One group of `dense_groups` ({role: tensor}) -> the dense tensor in `dtype`."""


CODECS: Registry[ExpertCodec] = Registry("quantization method")


def method_of(config) -> str | None:
    """The quantization method a transformers config declares (quantization_config.quant_method), or None."""
    qconfig = quantization_config(config)
    return None if qconfig is None else str(qconfig.get("quant_method"))


def quantization_config(config) -> dict | None:
    """The config's quantization_config as a dict, or None for an unquantized checkpoint."""
    qconfig = getattr(config, "quantization_config", None)
    return qconfig if qconfig is None or isinstance(qconfig, dict) else qconfig.to_dict()


def codec_for(config) -> ExpertCodec | None:
    """The codec of a checkpoint's config, None when unquantized; CheckpointError naming an unsupported method."""
    qconfig = quantization_config(config)
    if qconfig is None:
        return None
    method = qconfig.get("quant_method")
    if method not in CODECS:
        raise CheckpointError(f"unsupported quantization method {method!r} in the checkpoint's config.json; "
                              f"supported: {', '.join(CODECS.names()) or 'none'}")
    return CODECS.create(method, qconfig)
