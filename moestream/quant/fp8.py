"""FP8 block-scaled weights, as DeepSeek-V3/R1 and the official FP8 releases of Qwen3-MoE publish them and
transformers' finegrained FP8 integration reads them.

A linear weight `X.weight` [R, C] is stored in float8_e4m3fn beside `X.weight_scale_inv` float32
[ceil(R/bm), ceil(C/bn)], one scale per bm x bn block (`quantization_config.weight_block_size`, [128, 128];
the last block of a row or column may be partial), or one per tensor: W = float(q) * scale_inv of its block.
`Fp8Codec` decodes experts into scratch and dense FP8 weights once at load, with transformers' arithmetic
(the product in float32, then cast), bit for bit its dequantized model; `encode` is the inverse. Knows the
format only: no family, store or runtime."""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Sequence

import torch

from moestream.errors import CheckpointError
from moestream.quant.codec import CODECS, Tensors
from moestream.quant.linears import LinearCodec

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
METHOD = "fp8"
WEIGHT, SCALE = "weight", "weight_scale_inv"
ROLES = (WEIGHT, SCALE)  # the slot parts of one linear: "{param}.{j}.weight", "{param}.{j}.weight_scale_inv"
COMPANIONS = ("weight_scale_inv", "activation_scale")  # tensors beside an FP8 weight that are not weights
DEFAULT_BLOCK = (128, 128)


def scale_grid(shape: Sequence[int], block: Sequence[int] | None) -> tuple[int, ...]:
    """The shape of the scales of a weight of `shape` [R, C]: () per tensor, else [ceil(R/bm), ceil(C/bn)]."""
    return () if block is None else tuple(math.ceil(size / step) for size, step in zip(shape, block))


def encode(weight: torch.Tensor, block: Sequence[int] | None = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [R, C] -> (float8_e4m3fn [R, C], float32 scale_inv): each block's largest magnitude maps to 448."""
    values = weight.float()
    if block is None:
        amax = values.abs().amax()
    else:  # each block's, the partial blocks padded with zeros
        grid = scale_grid(values.shape, block)
        padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
        padded[: values.shape[0], : values.shape[1]] = values.abs()
        amax = padded.view(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))  # [ceil(R/bm), ceil(C/bn)]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (values / _expand(scale_inv, values.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, scale_inv


@functools.cache  # built once per device; read-only
def value_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """[256] float32: the value of every float8_e4m3fn byte."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(FP8).float()


def decode_into(weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor, block: Sequence[int] | None,
                table: torch.Tensor | None = None) -> torch.Tensor:
    """weight fp8 [R, C] and its scales -> out [R, C] (contiguous), in place: the float32 product, then cast, as
    transformers'. `table`: value_table() on the weight's device (a gather beats converting float8 on the CPU)."""
    table = value_table(weight.device) if table is None else table
    work = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
    torch.index_select(table, 0, weight.view(torch.uint8).reshape(-1).int(), out=work.view(-1))  # [R * C]
    scale = as_scale(scale_inv)  # work *= the scale of each one's block: a broadcast where whole blocks tile
    if block is not None and work.shape[0] % block[0] == 0 and work.shape[1] % block[1] == 0:
        grid = scale.shape
        work.view(grid[0], block[0], grid[1], block[1]).mul_(scale.view(grid[0], 1, grid[1], 1))
    else:
        work.mul_(_expand(scale, work.shape, block))
    return work if work is out else out.copy_(work)


def decode(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
           block: Sequence[int] | None) -> torch.Tensor:
    """The dense weight of an FP8 weight and its scales, in `dtype` (a new tensor)."""
    return decode_into(weight, scale_inv, torch.empty(weight.shape, dtype=dtype, device=weight.device), block)


def as_scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """Float32 scales; ue8m0 scales stored as uint8 bytes are 2 ** (byte - 127), as transformers reads them."""
    return torch.exp2(scale_inv.float() - 127.0) if scale_inv.dtype == torch.uint8 else scale_inv.float()


def _expand(scale: torch.Tensor, shape: Sequence[int], block: Sequence[int] | None) -> torch.Tensor:
    """Scales [rb, cb] -> one per element [R, C] (a per-tensor scale is returned as it is, to broadcast)."""
    if block is None:
        return scale
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


@CODECS.register(METHOD)
class Fp8Codec(LinearCodec):
    """FP8 experts: linear j of a part P (gate_proj.weight, then up_proj.weight, of gate_up_proj) becomes the slot
    parts `P.j.weight` and `P.j.weight_scale_inv`; decoding writes its rows of P. Dense FP8 weights decode at load."""

    method, roles = METHOD, {role: role for role in ROLES}

    def __init__(self, quantization_config: Mapping[str, Any]) -> None:
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2's release names the dtype
            raise CheckpointError(f"fp8 checkpoints with fmt {fmt!r} are not supported; supported: e4m3")
        block = quantization_config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise CheckpointError(f"fp8 weight_block_size must be two positive sizes, got {block}")
        self.block = None if block is None else (int(block[0]), int(block[1]))

    def linear_shape(self, layout: Mapping[str, tuple[int, ...]], prefix: str) -> tuple[int, int]:
        shape = layout[f"{prefix}.{WEIGHT}"]
        self._check_scales(prefix, shape, layout[f"{prefix}.{SCALE}"])
        return shape

    def decode_linear(self, parts: Tensors, prefix: str, target: torch.Tensor) -> int:
        weight = parts[f"{prefix}.{WEIGHT}"]  # [R, C] fp8
        decode_into(weight, parts[f"{prefix}.{SCALE}"], target[: weight.shape[0]], self.block)
        return weight.shape[0]

    def dense_groups(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        present = set(names)
        stems = [name.removesuffix(SCALE) for name in names if name.endswith("." + SCALE)]
        return {stem + WEIGHT: {role: stem + role for role in (WEIGHT, *COMPANIONS) if stem + role in present}
                for stem in stems if stem + WEIGHT in present}

    def decode_dense(self, tensors: Tensors, dtype: torch.dtype) -> torch.Tensor:
        weight, scale_inv = tensors[WEIGHT], tensors[SCALE]
        self._check_scales(WEIGHT, tuple(weight.shape), tuple(scale_inv.shape))
        return decode(weight, scale_inv, dtype, self.block)

    def _check_scales(self, name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
        expected = scale_grid(shape, self.block)
        if tuple(scale_shape) != expected and not (self.block is None and math.prod(scale_shape) == 1):
            raise CheckpointError(f"fp8 weight {name} {tuple(shape)} has scales {tuple(scale_shape)}; "
                                  f"blocks of {self.block} need {expected}")
