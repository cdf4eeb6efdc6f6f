"""MXFP4 experts (OCP microscaling FP4), as GPT-OSS publishes them and transformers' `integrations/mxfp4.py`
reads them. A weight W [..., R, C] (C a multiple of 32) is stored as two tensors:
- `*_blocks` uint8 [..., R, C/32, 16]: e2m1 codes, two per byte, column 2j in the low nibble, 2j+1 in the high;
- `*_scales` uint8 [..., R, C/32]: one e8m0 exponent per 32 values, the scale 2 ** (s - 127).
The dense weight that the model holds is the transpose [..., C, R] (GPT-OSS: gate_up_proj [H, 2I] is stored as
blocks [2I, H/32, 16]). Experts are fused over experts on disk ([E, ...]); biases stay unquantized.

`Mxfp4Codec` decodes with transformers' arithmetic (a lookup of the e2m1 value in the compute dtype, then
ldexp), bit for bit its dequantized model; `encode` is the inverse. Knows the format only: no family, store
or runtime."""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch

from moestream.errors import CheckpointError
from moestream.families.base import ExpertPart
from moestream.quant.codec import CODECS, Shapes, Tensors

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes of E2M1[:8]
GROUP = 32  # values per scale
BIAS = 127  # e8m0 exponent bias
BLOCKS, SCALES = "_blocks", "_scales"


def encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., C] -> (blocks uint8 [..., C/32, 16], scales uint8 [..., C/32]): the smallest power-of-two
    scale per 32 values that fits their largest magnitude within e2m1's 6, then each value to the nearest code."""
    if weight.shape[-1] % GROUP:
        raise CheckpointError(f"MXFP4 needs the quantized dimension to be a multiple of {GROUP}, got {weight.shape[-1]}")
    groups = weight.float().contiguous().unflatten(-1, (-1, GROUP))  # [..., G, 32]
    amax = groups.abs().amax(-1)  # [..., G]
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-BIAS, BIAS)  # an all-zero group: -inf -> -127
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitude = torch.bucketize(scaled.abs(), torch.tensor(E2M1_MIDPOINTS))  # [..., G, 32] in 0..7
    codes = (magnitude + 8 * ((scaled < 0) & (magnitude > 0))).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks.contiguous(), (exponent + BIAS).to(torch.uint8)


@functools.cache  # built once per (dtype, device); read-only
def nibble_tables(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """([256], [256]): the e2m1 value of every byte's low nibble and of its high nibble, in `dtype`."""
    values, codes = torch.tensor(E2M1, dtype=dtype, device=device), torch.arange(256, device=device)
    return values[codes & 0x0F], values[codes >> 4]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values are scaled in: `dtype` where every power of two of e8m0 fits it, else float32."""
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


def decode_into(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """blocks uint8 [R, G, 16], scales uint8 [R, G] -> out [G*32, R] (the model's layout, contiguous), in place;
    `tables`: nibble_tables(work_dtype(out.dtype)). Each value is its e2m1 value times 2 ** (s - 127) rounded once,
    as transformers' ldexp: the bytes transposed first, then each nibble a 1-D gather into the model's layout."""
    rows, groups, half = blocks.shape
    work = out if out.dtype == tables[0].dtype else torch.empty(out.shape, dtype=tables[0].dtype, device=out.device)
    codes = blocks.view(rows, groups * half).T.contiguous().view(-1).int()  # [G*16 * R]: byte (c/2, r)
    nibbles = [torch.index_select(table, 0, codes).view(groups * half, rows) for table in tables]  # [G*16, R]
    torch.stack(nibbles, dim=1, out=work.view(groups * half, 2, rows))  # columns 2j, 2j+1 of disk row r
    exponents = (scales.int() - BIAS).T.contiguous()  # [G, R]
    powers = torch.ldexp(torch.ones(exponents.shape, dtype=work.dtype, device=work.device), exponents)
    work.view(groups, 2 * half, rows).mul_(powers.unsqueeze(1))  # exact: a power of two times two bits
    return work if work is out else out.copy_(work)


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., R, G, 16], scales [..., R, G] -> the dense weight [..., G*32, R] in `dtype` (a new tensor)."""
    *lead, rows, groups, half = blocks.shape
    out = torch.empty(*lead, groups * 2 * half, rows, dtype=dtype, device=blocks.device)
    tables = nibble_tables(work_dtype(dtype), blocks.device)
    flat_out = out.view(-1, groups * 2 * half, rows)
    for index, (b, s) in enumerate(zip(blocks.view(-1, rows, groups, half), scales.view(-1, rows, groups))):
        decode_into(b, s, flat_out[index], tables)
    return out


@CODECS.register("mxfp4")
class Mxfp4Codec:
    """GPT-OSS's MXFP4 experts: each fused weight part `P` becomes the slot parts `P_blocks` and `P_scales`
    (the expert's slices of the disk tensors `P_blocks`, `P_scales`); bias parts stay as they are."""

    def __init__(self, quantization_config: Mapping[str, Any]) -> None:
        pass  # every MXFP4 config reads alike

    def disk_parts(self, parts: Sequence[ExpertPart]) -> tuple[ExpertPart, ...]:
        quantized = []
        for part in parts:
            if part.param.endswith("_bias"):
                quantized.append(part)
                continue
            if not part.fused_on_disk or len(part.disk) != 1:
                raise CheckpointError(f"mxfp4 experts are read from tensors fused over experts (GPT-OSS's layout); "
                                      f"part {part.param} is stored as {', '.join(part.disk)}")
            quantized += [ExpertPart(part.param + suffix, (part.disk[0] + suffix,), fused_on_disk=True)
                          for suffix in (BLOCKS, SCALES)]
        return tuple(quantized)

    def dense_shapes(self, layout: Mapping[str, tuple[int, ...]]) -> Shapes:
        shapes = {}
        for name, shape in layout.items():
            if name.endswith(BLOCKS):
                rows, groups, half = shape
                param = name.removesuffix(BLOCKS)
                if tuple(layout[param + SCALES]) != (rows, groups):
                    raise CheckpointError(f"mxfp4 part {param}: scales {layout[param + SCALES]} do not match "
                                          f"blocks {shape}")
                shapes[param] = (groups * 2 * half, rows)
        return shapes

    def decode(self, parts: Tensors, out: Tensors) -> Tensors:
        for param, dense in out.items():
            decode_into(parts[param + BLOCKS], parts[param + SCALES], dense,
                        nibble_tables(work_dtype(dense.dtype), dense.device))
        return dict(out) | {name: part for name, part in parts.items() if not name.endswith((BLOCKS, SCALES))}

    def dense_groups(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        return {}  # every non-expert tensor is unquantized

    def decode_dense(self, tensors: Tensors, dtype: torch.dtype) -> torch.Tensor:
        raise CheckpointError("this quantization method stores no quantized dense tensors")
